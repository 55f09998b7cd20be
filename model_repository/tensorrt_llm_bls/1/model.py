"""TensorRT-LLM's tensorrt_llm_bls model on pagoda: the front in ``pagoda.serving.trtllm_front``."""

from pagoda.serving.trtllm_front import TritonPythonModel  # noqa: F401
