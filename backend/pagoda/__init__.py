"""pagoda: LLM serving on NVIDIA Triton Inference Server.

``from pagoda import LLM, SamplingParams`` gives the offline API; the heavy imports
(torch, the model) happen only when ``LLM`` is first touched.
"""

from pagoda.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from pagoda.engine.llm import LLM

        return LLM
    if name == "EngineConfig":
        from pagoda.engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
