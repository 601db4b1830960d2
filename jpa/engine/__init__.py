"""Continuous batching: requests -> scheduler -> jitted device loop, over any model that meets
`EngineModel` (the engine never imports the models layer; scripts wire one in)."""

from jpa.engine.engine import EngineConfig, EngineStats, LLMEngine
from jpa.engine.model import EngineModel, ModelSizes
from jpa.engine.request import Request, RequestOutput, Status, StepOutput
from jpa.engine.sampling import SamplingParams
from jpa.engine.scheduler import Scheduler

__all__ = ["EngineConfig", "EngineModel", "EngineStats", "LLMEngine", "ModelSizes", "Request", "RequestOutput",
           "SamplingParams", "Scheduler", "Status", "StepOutput"]
