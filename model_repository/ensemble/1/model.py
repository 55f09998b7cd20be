"""TensorRT-LLM's ensemble model on pagoda: the front in ``pagoda.serving.trtllm_front``."""

from pagoda.serving.trtllm_front import TritonPythonModel  # noqa: F401
