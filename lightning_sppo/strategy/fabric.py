"""The Fabric strategy "sppo": owns devices and precision, delegates each step to the runtime.

Usage::

    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=4), accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(model, optimizer)
    loss = fabric.strategy.forward_backward(model, input_ids, targets)
    optimizer.step()
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch
from lightning.fabric.plugins import CheckpointIO, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, SingleDeviceStrategy
from lightning.fabric.wrappers import _FabricModule
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_sppo.attention import apply_subsequence_attention, select_kernel
from lightning_sppo.attention.kernels import KERNEL_NAMES
from lightning_sppo.partition import PARTITION_POLICIES
from lightning_sppo.runtime import SubsequenceEngine

__all__ = ["SPPOStrategy"]

OffloadName = Literal["none", "full", "adaptive"]
PartitionName = Literal["length", "flops", "adaptive"]


class SPPOStrategy(SingleDeviceStrategy):
    """Sequence pipeline parallel offloading (SPPO) for long-sequence training.

    This version runs on one device (CPU or one GPU), chosen by Fabric's ``accelerator``/``devices``.

    Args:
        num_subsequences: N, the number of subsequences each sequence is cut into, or ``"auto"``.
        partition: how the sequence is cut: ``"length"`` (equal), ``"flops"`` (equal FLOPs, Seq1F1B) or
            ``"adaptive"`` (chosen with the offload policy).
        offload: share of each subsequence's saved activations sent to host memory: ``"none"``,
            ``"full"`` or ``"adaptive"``.
        attention: attention kernel: ``"auto"`` (flash-attn on GPU when installed, else PyTorch's flash
            kernels), ``"sdpa"``, ``"flash_attn"`` or ``"reference"`` (pure PyTorch).
        loss_chunk_tokens: tokens per chunk of the vocabulary projection + cross-entropy; ``None`` keeps one
            chunk's fp32 logits near 128 MiB.
        granularity: subsequence boundaries fall on multiples of this many tokens (e.g. the kernel's block).
        device: the device when the strategy is used without Fabric's ``accelerator``/``devices``.
    """

    def __init__(
        self,
        num_subsequences: int | Literal["auto"] = "auto",
        partition: PartitionName = "length",
        offload: OffloadName = "none",
        attention: str = "auto",
        loss_chunk_tokens: int | None = None,
        granularity: int = 1,
        device: str | torch.device = "cpu",
        accelerator: Any = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        super().__init__(device=device, accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        _check_choice("partition", partition, tuple(PARTITION_POLICIES))
        _check_choice("offload", offload, get_args(OffloadName))
        _check_choice("attention", attention, KERNEL_NAMES)
        if offload != "none":
            raise NotImplementedError(
                f"offload={offload!r} is not available in this version of lightning-sppo; use offload='none'."
            )
        if granularity < 1:
            raise ValueError(f"granularity must be a positive integer, got granularity={granularity}.")
        if loss_chunk_tokens is not None and loss_chunk_tokens < 1:
            raise ValueError(
                f"loss_chunk_tokens must be a positive integer, got loss_chunk_tokens={loss_chunk_tokens}."
            )
        self.offload = offload
        self.engine = SubsequenceEngine(
            num_subsequences=num_subsequences,
            partition=partition,
            attention=attention,
            loss_chunk_tokens=loss_chunk_tokens,
            granularity=granularity,
        )
        self._num_nodes = 1
        self._parallel_devices: list[torch.device] | None = None

    @property
    def num_subsequences(self) -> int | Literal["auto"]:
        return self.engine.num_subsequences

    @property
    def partition(self) -> str:
        return self.engine.partition

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The devices Fabric's ``accelerator``/``devices`` selected (Fabric's connector fills this in)."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self._parallel_devices = devices

    @property
    @override
    def root_device(self) -> torch.device:
        return self._parallel_devices[0] if self._parallel_devices else self._root_device

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @override
    def _configure_launcher(self) -> None:
        devices = len(self._parallel_devices or [None])
        if devices * self._num_nodes > 1:
            raise NotImplementedError(
                f"SPPOStrategy runs on one device in this version, got devices={devices},"
                f" num_nodes={self._num_nodes}; use devices=1, num_nodes=1."
            )

    @override
    def setup_module(self, module: Module) -> Module:
        apply_subsequence_attention(module, select_kernel(self.engine.attention, self.root_device))
        return module

    @override
    def module_to_device(self, module: Module) -> None:
        module.to(self.root_device)

    def forward_backward(self, model: Module, input_ids: Tensor, targets: Tensor) -> Tensor:
        """Forward and backward of every subsequence of the batch; returns the detached mean loss.

        Gradients are left in the parameters' ``.grad`` (accumulated, as with ``loss.backward()``);
        call ``optimizer.step()`` next. ``targets`` has the shape of ``input_ids``; -100 is ignored.
        """
        module = model.module if isinstance(model, _FabricModule) else model
        device = self.root_device
        if input_ids.device != device or targets.device != device:
            input_ids, targets = input_ids.to(device), targets.to(device)
        return self.engine.forward_backward(
            module,
            input_ids,
            targets,
            backward=lambda loss: self.backward(loss, module),
            forward_context=self.precision.forward_context,
        )

    @override
    def teardown(self) -> None:
        self.engine.release()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("sppo", cls, description="Sequence pipeline parallel offloading", override=True)


def _check_choice(setting: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"Unknown {setting}={value!r}; choose one of {list(choices)}.")


SPPOStrategy.register_strategies(STRATEGY_REGISTRY)
