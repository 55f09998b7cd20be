"""The vocabularies a request arrives in, one module each, each the only reader of its own.

- ``tensors``: how every dialect reads Triton input tensors (one value, text, word lists,
  flags, numbers, token ids; errors naming the input) and ``DialectRequest``, what a reader
  makes of a request: the prompt and typed values under pagoda's names;
- ``vllm``: Triton's vLLM backend (``sampling_parameters`` JSON, request parameters,
  ``structured_outputs``; its ``logprobs`` / ``finish_reason`` shapes);
- ``trtllm``: TensorRT-LLM's scalars, word lists and beam inputs, its ``ensemble`` /
  ``tensorrt_llm_bls`` interface and outputs;
- ``llmapi``: TensorRT-LLM's LLM-API ``tensorrt_llm`` model;
- ``pagoda``: pagoda's own model's inputs (contract 1: the vLLM backend's vocabulary plus
  TensorRT-LLM style scalars), ``INPUTS`` (its config.pbtxt), LoRA control requests.

``serving.wire.WireRequest.from_dialect`` checks what a reader made into the typed request.
To add a dialect: one module here that reads its inputs into a ``DialectRequest`` (and, if it
has its own outputs, turns pagoda's responses into them), a front model that calls it
(``serving.trtllm_front`` shows how), and the router's schema of its inputs in
``fleet.gate.generate_body``. Nothing else changes. These modules never import ``wire``.
"""
