"""Model families that load Hugging Face checkpoints and run over the paged KV cache."""

from radixrt.models.config import ModelConfig
from radixrt.models.registry import MODEL_FAMILIES, load_model, reload_weights

__all__ = ["MODEL_FAMILIES", "ModelConfig", "load_model", "reload_weights"]
