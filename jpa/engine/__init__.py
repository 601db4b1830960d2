"""Host-side continuous batching: requests -> scheduler -> jitted device loop (imports the models layer)."""

from jpa.engine.engine import EngineConfig, EngineStats, LLMEngine
from jpa.engine.request import Request, RequestOutput, Status
from jpa.engine.sampling import SamplingParams

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "Request", "RequestOutput", "SamplingParams", "Status"]
