"""Shared fixtures and helpers: tiny configs and a plain single-process reference step."""

from __future__ import annotations

import copy
import math
import os
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric

from lightning_sppo import GPT, GPTConfig, SPPOStrategy
from tests.subprocesses import ONE_THREAD

pytest_plugins = ["tests.suite_record"]  # writes the run's record where SPPO_SUITE_RECORD says (.ci/run)

IGNORE = -100

# One thread in the test process, and (through the environment) in every process it starts. Tiny tensors gain
# nothing from threads, and on a loaded 2-core machine OpenMP spin-waits make them far slower: the one-device
# Trainer test took 39 s with the default threads at load 11, 1.4 s with one.
torch.set_num_threads(1)
for _name, _value in ONE_THREAD.items():
    os.environ.setdefault(_name, _value)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test sees the environment the session started with: a process group a test starts sets MASTER_ADDR and
    MASTER_PORT (Lightning's ``_init_dist_connection``), and a later test's processes must not inherit them..."""
    saved = dict(os.environ)
    had_group = dist.is_initialized()
    yield
    if dist.is_initialized() and not had_group:
        # ...and no process group: a later test reading the world size (failures.py) would see this one of one.
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _deterministic_defaults():
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(default_dtype)


@pytest.fixture
def one_thread():
    """One intra-op thread, also where a test or an import changed it: tiny tensors gain nothing from threads, and
    on a busy shared machine OpenMP spin-waits can make a step 100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def parity_config(gqa: bool = False, **overrides) -> GPTConfig:
    """A tiny model whose attention term is large enough that the flops partition is uneven."""
    base = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=64, intermediate_size=32, block_size=256)
    return GPTConfig(**(base | dict(n_query_groups=2 if gqa else 4) | overrides))


def make_batch(config: GPTConfig, batch_size: int, seq_len: int, ignore_fraction: float = 0.2, seed: int = 0):
    """Random ids and targets with some targets set to -100 (never all of them)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=gen)
    targets = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=gen)
    ignore = torch.rand(batch_size, seq_len, generator=gen) < ignore_fraction
    ignore[0, 0] = True
    ignore[-1, -1] = False
    return ids, targets.masked_fill(ignore, IGNORE)


def plain_loss_and_grads(model: GPT, ids: torch.Tensor, targets: torch.Tensor):
    """The reference: full-sequence logits, mean cross-entropy over valid targets, backward."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    logits = ref(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in ref.named_parameters()}


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (an all-gather over its mesh; every rank must call it); a plain one as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def old_reset_parameters(model: GPT) -> None:
    """The initialisation before issue 39, for negative controls: each parameter in turn from the global generator
    (a stage drew other weights than the whole model; meta parameters are left for later)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_meta:
                continue
            if name.endswith(("norm_1.weight", "norm_2.weight", "norm_f.weight")):
                param.fill_(1.0)
            elif name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                param.normal_(0.0, 0.02 / math.sqrt(2 * model.config.n_layer))
            else:
                param.normal_(0.0, 0.02)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (absolute where b is below 1e-12)."""
    b = b.double()
    return ((a.double() - b).norm() / b.norm().clamp(min=1e-12)).item()


def launch_fabric(world_size: int, **strategy_settings) -> Fabric:
    """A launched Fabric on ``world_size`` CPU processes with ``SPPOStrategy(**strategy_settings)`` (inside a
    ``tests.distributed.harness`` worker, which already runs one process per rank)."""
    fabric = Fabric(strategy=SPPOStrategy(**strategy_settings), accelerator="cpu", devices=world_size)
    fabric.launch()
    return fabric


@contextmanager
def no_attribute_set(*objects):
    """Inside, assigning or deleting any attribute of ``objects`` raises ``AttributeError`` naming it: a step plan is
    handed to an engine, and nothing sets an engine's attributes per step (DESIGN.md, "A step's plan is a value")."""

    def refuse(obj, name, *value):
        raise AttributeError(f"{type(obj).__mro__[1].__name__}.{name} was set during a step")

    classes = [type(obj) for obj in objects]
    for obj, cls in zip(objects, classes, strict=True):
        guarded = type(f"Guarded{cls.__name__}", (cls,), {"__setattr__": refuse, "__delattr__": refuse})
        object.__setattr__(obj, "__class__", guarded)
    try:
        yield
    finally:
        for obj, cls in zip(objects, classes, strict=True):
            object.__setattr__(obj, "__class__", cls)


def max_relative_error(grads: dict[str, torch.Tensor], model: torch.nn.Module) -> tuple[float, str]:
    """Largest ||g - g_ref|| / ||g_ref|| over parameters, and the parameter it occurs at."""
    worst, where = 0.0, ""
    for name, p in model.named_parameters():
        ref = grads[name]
        err = ((p.grad - ref).norm() / ref.norm().clamp(min=1e-30)).item()
        if err > worst:
            worst, where = err, name
    return worst, where


def document_ids_from_lengths(rows: list[list[int]]) -> torch.Tensor:
    """document_ids [B, S] from per-row document lengths (every row must sum to the same S); ids start at 7 per
    row and step by 1 or 3, so tests never rely on ids being 0, 1, 2, ..."""
    out = []
    for lengths in rows:
        ids, value = [], 7
        for i, n in enumerate(lengths):
            ids += [value] * n
            value += 1 if i % 2 else 3
        out.append(ids)
    if len({len(r) for r in out}) != 1:
        raise ValueError(f"rows of different lengths: {[len(r) for r in out]}")
    return torch.tensor(out)


def random_document_lengths(gen: torch.Generator, seq_len: int, max_length: int) -> list[int]:
    """Random document lengths summing to seq_len, with short ones (length 1) likely."""
    lengths, left = [], seq_len
    while left:
        n = int(torch.randint(1, min(max_length, left) + 1, (1,), generator=gen))
        lengths.append(n)
        left -= n
    return lengths


def separate_documents_loss_and_grads(model: GPT, ids: torch.Tensor, targets: torch.Tensor, document_ids):
    """The reference for packed documents: every document of every row alone through the plain model; the loss
    sums every token's cross-entropy over the valid targets of the whole batch and divides by their count."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for row in range(ids.shape[0]):
        for doc in document_ids[row].unique_consecutive():
            cols = (document_ids[row] == doc).nonzero().flatten()
            logits = ref(ids[row : row + 1, cols])[0]
            total = total + F.cross_entropy(logits, targets[row, cols], ignore_index=IGNORE, reduction="sum")
    loss = total / (targets != IGNORE).sum().clamp(min=1)
    loss.backward()
    grads = {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for name, p in ref.named_parameters()}
    return loss.detach(), grads
