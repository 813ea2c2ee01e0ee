"""Sluice engine: paged KV cache, chunked-prefill continuous batching, prefix caching (docs/architecture.md §3)."""
from engine.config import EngineConfig
from engine.engine import DeviceError, LLMEngine, StepError
from engine.request import (Checkpoint, CompletionOutput, InvalidSamplingParam, PromptLogprob, PromptTooLongError,
                            RequestOutput, SamplingParams, TokenLogprob)
from engine.structured import StructuredOutput

__all__ = ["LLMEngine", "EngineConfig", "SamplingParams", "StepError", "DeviceError", "Checkpoint",
           "PromptTooLongError", "InvalidSamplingParam", "RequestOutput", "CompletionOutput", "TokenLogprob",
           "PromptLogprob", "StructuredOutput"]
