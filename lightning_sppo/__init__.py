"""lightning-sppo: train language models on very long sequences with SPPO, as a Lightning strategy.

Importing the package registers the strategy name "sppo" with Fabric and with the Trainer.
"""

from lightning_sppo import partition
from lightning_sppo.errors import SPPOConfigError
from lightning_sppo.model import GPT, GPTConfig
from lightning_sppo.runtime import SubsequenceEngine
from lightning_sppo.strategy import SPPOConfig, SPPOStrategy, SPPOTrainerStrategy

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "GPTConfig",
    "SPPOConfig",
    "SPPOConfigError",
    "SPPOStrategy",
    "SPPOTrainerStrategy",
    "SubsequenceEngine",
    "partition",
]
