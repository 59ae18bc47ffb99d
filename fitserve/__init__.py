"""fitserve: a memory-aware LLM inference engine with a capacity planner built in."""

__all__ = ["LLM", "BeamSearchParams", "Engine", "SamplingParams", "EngineConfig"]


def __getattr__(name: str) -> object:
    # Lazy so that `fitserve plan` and the torch-free parts import without torch start-up cost.
    if name == "LLM":
        from fitserve.engine.llm import LLM

        return LLM
    if name == "Engine":
        from fitserve.engine.core import Engine

        return Engine
    if name == "SamplingParams":
        from fitserve.sampling import SamplingParams

        return SamplingParams
    if name == "BeamSearchParams":
        from fitserve.sampling.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "EngineConfig":
        from fitserve.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
