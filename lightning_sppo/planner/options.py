"""What a run keeps besides the layout: recompute, K/V spilled to host, model state on host (``SPPOConfig``).

Each trades time for memory, so the solver tries them cheapest first (``planner.solver``): a run that fits
without them gets none; otherwise every allowed combination is evaluated and the fastest that fits wins. A
request may pin any of them, as the strategies do with their own settings (``strategy/autoplan.py``).

* ``recompute`` ("none", "selective", "full"): what each block keeps for backward (``planner.activations``), and
  the forward it runs again in backward (``planner.costs``).
* ``kv_device_tokens`` R: each layer's K/V and dK/dV of tokens [0, R) stay on the device, the rest in pinned host
  memory, streamed back in chunks of ``kv_chunk_tokens`` (``planner.memory.kv_spill_bytes``). The planner chooses
  the largest R that fits (``KV_AUTO``); None keeps everything on the device.
* ``model_state`` ("device", "host"): parameters, gradients and AdamW on host through FSDP2's CPUOffloadPolicy
  (``planner.memory.model_state_bytes``), the optimizer step on the CPU (``planner.costs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_sppo.recompute import RECOMPUTE_MODES

__all__ = ["KV_AUTO", "MODEL_STATE_ORDER", "RECOMPUTE_ORDER", "KVDeviceTokens", "RunOptions"]

RECOMPUTE_ORDER: tuple[str, ...] = RECOMPUTE_MODES
"""Recompute modes, least recomputed first: "none", "selective", "full"."""
MODEL_STATE_ORDER: tuple[str, ...] = ("device", "host")
"""Where model state lives (``strategy.config.MODEL_STATE_PLACES``), device first."""
KV_AUTO = "auto"
"""``kv_device_tokens`` of a request that lets the planner keep the largest prefix that fits (or all of it)."""
KVDeviceTokens = int | None | Literal["auto"]
DEFAULT_KV_CHUNK_TOKENS = 16384


@dataclass(frozen=True)
class RunOptions:
    """One combination the planner evaluates; ``kv_device_tokens`` is R, or None when all K/V stay on the device."""

    recompute: str = "none"
    model_state: str = "device"
    kv_device_tokens: int | None = None
    kv_chunk_tokens: int = DEFAULT_KV_CHUNK_TOKENS

    @property
    def host_state(self) -> bool:
        return self.model_state == "host"

    def spills(self, seq_len: int) -> bool:
        """Whether some of the K/V of a ``seq_len``-token sequence lives on host."""
        return self.kv_device_tokens is not None and self.kv_device_tokens < seq_len
