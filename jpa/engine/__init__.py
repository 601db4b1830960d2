"""Continuous batching: requests -> scheduler -> jitted device loop, over any model that meets
`EngineModel` (the engine never imports the models layer; scripts wire one in)."""

from jpa.engine.async_engine import AsyncEngine, EngineDead, EngineOverloaded, RequestGroup, Snapshot
from jpa.engine.engine import EngineConfig, EngineStats, LLMEngine
from jpa.engine.lora import LoRARequest
from jpa.engine.model import EngineModel, ModelSizes
from jpa.engine.batch import StepBatch, StepResult
from jpa.engine.request import Phase, PromptLogprob, Request, RequestOutput, StepOutput
from jpa.engine.sampling import SamplingParams, SlotParams
from jpa.engine.scheduler import Scheduler
from jpa.engine.shapes import EngineShapes
from jpa.engine.speculative import SpeculativeConfig
from jpa.engine.structured import StructuredOutputs

__all__ = ["AsyncEngine", "EngineConfig", "EngineDead", "EngineModel", "EngineOverloaded", "EngineShapes", "EngineStats", "LLMEngine",
           "LoRARequest", "ModelSizes", "Phase", "PromptLogprob", "Request", "RequestGroup", "RequestOutput", "SamplingParams", "Scheduler",
           "SlotParams", "Snapshot", "SpeculativeConfig", "StepBatch", "StepOutput", "StepResult", "StructuredOutputs"]
