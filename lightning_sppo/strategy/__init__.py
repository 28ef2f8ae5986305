"""The "sppo" strategy for Fabric (registered on import)."""

from lightning_sppo.strategy.fabric import SPPOStrategy

__all__ = ["SPPOStrategy"]
