"""llm-cluster: the engine as a library. `from cluster import LLM, SamplingParams`."""
from cluster.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "EngineConfig"]


def __getattr__(name: str):
    # Lazy: importing the package (e.g. for SamplingParams) must not load torch models.
    if name == "LLM":
        from cluster.engine.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from cluster import outputs
        return getattr(outputs, name)
    if name == "EngineConfig":
        from cluster.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
