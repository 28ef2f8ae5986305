"""The GPT family: configuration registry and the plain full-sequence model."""

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.model.gpt import GPT

__all__ = ["GPT", "GPTConfig"]
