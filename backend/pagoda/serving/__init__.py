"""Serving pagoda on Triton Inference Server (see docs/serving.md).

- ``triton_io``: request tensors -> ``ParsedRequest``; engine outputs -> response tensors.
- ``engine_loop``: the engine-owning thread; ``commands``: what its queue carries;
  ``response_sender``: the thread that sends responses; ``observers``: metrics, tracer and
  fleet publisher as step observers.
- ``trtllm_dialect``: TensorRT-LLM's ``ensemble`` / ``tensorrt_llm_bls`` interface <-> pagoda's
  inputs and outputs; ``trtllm_llmapi``: its LLM-API ``tensorrt_llm`` model's; ``trtllm_front``:
  those front models' Triton glue (BLS to pagoda's model).
- ``metrics``: vLLM-named metrics through ``pb_utils.MetricFamily``.
- ``model_config``: config.pbtxt parameters <-> ``EngineConfig``.
- ``launcher``: ``pagoda serve`` (the tritonserver from the nvidia-pytriton wheel).
- ``client``: a small tritonclient helper for streaming generation.
"""
