"""The "sppo" strategy for Fabric and for the Trainer (both registered on import), sharing one core."""

from lightning_sppo.strategy.config import SPPOConfig
from lightning_sppo.strategy.fabric import SPPOStrategy
from lightning_sppo.strategy.trainer import SPPOTrainerStrategy

__all__ = ["SPPOConfig", "SPPOStrategy", "SPPOTrainerStrategy"]
