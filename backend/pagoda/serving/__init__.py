"""Serving pagoda on Triton Inference Server (see docs/serving.md).

- ``wire``: ``WireRequest``, the one typed request from every door to the engine (Triton
  tensors and JSON in one canonical form); ``dialects/``: the vocabularies that read into it
  (pagoda's model, the vLLM backend's, TensorRT-LLM's, its LLM API's), one reader each;
  ``responses``: engine outputs -> response tensors.
- ``engine_loop``: the engine-owning thread; ``commands``: what its queue carries;
  ``response_sender``: the thread that sends responses; ``observers``: metrics, tracer and
  fleet publisher as step observers.
- ``trtllm_front``: TensorRT-LLM's front models' Triton glue (``ensemble``,
  ``tensorrt_llm_bls``, the LLM-API ``tensorrt_llm``: BLS to pagoda's model).
- ``metrics``: vLLM-named metrics through ``pb_utils.MetricFamily``.
- ``model_config``: config.pbtxt parameters <-> ``EngineConfig``.
- ``launcher``: ``pagoda serve`` (the tritonserver from the nvidia-pytriton wheel).
- ``client``: a small tritonclient helper for streaming generation.
"""
