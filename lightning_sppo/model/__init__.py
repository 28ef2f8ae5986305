"""The GPT family: configuration registry, the plain full-sequence model, Hugging Face conversion (``hf``)."""

from lightning_sppo.model.config import GPTConfig, RopeScaling
from lightning_sppo.model.gpt import GPT

__all__ = ["GPT", "GPTConfig", "RopeScaling"]
