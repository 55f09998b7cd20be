"""TensorRT-LLM's LLM-API model (tensorrt_llm) on pagoda: the front in ``pagoda.serving.trtllm_front``."""

from pagoda.serving.trtllm_front import LLMAPIFront as TritonPythonModel  # noqa: F401
