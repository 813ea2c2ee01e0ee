"""Model forwards over a flattened, unpadded token batch. One family for now: llama (incl. Qwen2/3)."""
from engine.models.llama import ARCHITECTURES, LlamaModel, ModelConfig

__all__ = ["ARCHITECTURES", "LlamaModel", "ModelConfig"]
