"""FSDP2 mixed precision and the per-subsequence sync modes (``parallel/fsdp.py``), on gloo with real processes.

* fp32, sync "reduce" and "regather": the plain model's loss, every gradient and the SGD update (relative error
  < 1e-5), as "step" gives them (``test_parity.py``).
* bf16 mixed precision (``FSDPOptions(param_dtype=torch.bfloat16)`` under CPU autocast, as Fabric's bf16-mixed
  runs it) through a 2-stage pipeline with FSDP over dp=2: blocks compute with bf16 weights, the fp32 shards
  stay the master weights and receive fp32 gradients, messages pass, and loss and gradients stay close to fp32.
* Memory: what a rank holds at its peak (the first backward), measured from live tensors, against the planner.

The workers call ``parallelize_gpt`` and ``PipelineRuntime`` directly, with the mesh the strategy core builds.
"""

from __future__ import annotations

import copy
import gc
import os
import warnings
import weakref
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.parallel import parallelize_gpt
from lightning_sppo.parallel.fsdp import FSDPOptions
from lightning_sppo.partition import flops
from lightning_sppo.planner import CostModel, Layout, precision_bytes, stage_specs
from lightning_sppo.planner.evaluate import Limits, evaluate
from lightning_sppo.planner.layout import placement
from lightning_sppo.planner.memory import stage_parameter_counts
from lightning_sppo.runtime.pipeline import PipelineRuntime
from lightning_sppo.step_plan import StepPlan
from lightning_sppo.strategy.config import SPPOConfig
from lightning_sppo.strategy.core import SPPOCore
from tests.conftest import full_tensor, make_batch, parity_config, plain_loss_and_grads, relative_error
from tests.distributed.harness import run_distributed
from tests.planner.conftest import UNLIMITED

pytestmark = pytest.mark.slow  # several processes (gloo) per test

CPU = torch.device("cpu")
S = 48
LR = 0.1


def _core(rank: int, world_size: int, pp: int, sp: int) -> SPPOCore:
    """The process group and the (pp, dp, sp) mesh, as the strategies set them up."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)  # every rank builds the same plain model
    core = SPPOCore(SPPOConfig(pipeline_parallel=pp, sequence_parallel=sp))
    core.set_world_size(world_size)
    core.build_mesh(CPU, rank, local_processes=world_size)
    return core


def _stage(core: SPPOCore, model: GPT, fsdp: FSDPOptions, hooks=None):
    stage = parallelize_gpt(model, core.dims, core.mesh, CPU, attention="sdpa", fsdp=fsdp)
    return stage, PipelineRuntime(stage, core._groups(), hooks=hooks)


def _rows(core: SPPOCore, rank: int, per_dp: int) -> slice:
    dp_rank = core.dims.coordinates(rank)[1]
    return slice(dp_rank * per_dp, (dp_rank + 1) * per_dp)


# -- fp32: per-subsequence sync gives the plain model's numbers ---------------------------------------


def sync_modes_match_plain(rank: int, world_size: int, pp: int, sp: int) -> None:
    core = _core(rank, world_size, pp, sp)
    config = parity_config(gqa=True, n_layer=max(2, pp))
    plain = GPT(config)
    ids, targets = make_batch(config, 2 * core.dims.dp, S, seed=3)
    ref_loss, ref_grads = plain_loss_and_grads(plain, ids, targets)
    rows = _rows(core, rank, 2)
    lengths = flops(S, 3, sp, config=config)
    for sync in ("reduce", "regather"):
        stage, runtime = _stage(core, copy.deepcopy(plain), FSDPOptions(sync=sync))
        optimizer = torch.optim.SGD(stage.parameters(), lr=LR)
        loss = runtime.step(ids[rows], targets[rows], StepPlan(lengths))
        case = f"rank {rank} sync={sync} pp={pp} sp={sp}"
        assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (case, loss.item(), ref_loss.item())
        plain_params = dict(plain.named_parameters())
        for name, param in stage.model.named_parameters():
            assert relative_error(full_tensor(param.grad), ref_grads[name]) < 1e-5, f"{case}: grad of {name}"
        optimizer.step()
        for name, param in stage.model.named_parameters():
            expected = plain_params[name].detach() - LR * ref_grads[name]
            assert relative_error(full_tensor(param.detach()), expected) < 1e-5, f"{case}: {name} after SGD"


@pytest.mark.parametrize(("pp", "sp"), [(1, 1), (1, 2)], ids=["dp2", "sp2"])
def test_per_subsequence_sync_matches_plain_model(pp, sp):
    run_distributed(sync_modes_match_plain, 2, pp, sp)


# -- bf16 mixed precision through a pipeline ------------------------------------------------------------


def mixed_precision_pipeline(rank: int, world_size: int) -> None:
    core = _core(rank, world_size, 2, 1)  # pp=2, dp=2: FSDP on each stage, bf16 messages between them
    config = parity_config(gqa=True, n_layer=2)
    plain = GPT(config)
    ids, targets = make_batch(config, 4, S, seed=5)
    ref_loss, ref_grads = plain_loss_and_grads(plain, ids, targets)
    rows = _rows(core, rank, 2)
    for sync in ("step", "regather"):
        stage, runtime = _stage(core, copy.deepcopy(plain), FSDPOptions(param_dtype=torch.bfloat16, sync=sync))
        seen = _record_block_dtypes(stage)
        loss = runtime.step(
            ids[rows], targets[rows], StepPlan(flops(S, 3, 1, config=config)), forward_context=_autocast
        )
        case = f"rank {rank} sync={sync}"
        assert seen and all(s == (torch.bfloat16, torch.bfloat16) for s in seen), (case, seen)
        assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 2e-2, (case, loss.item(), ref_loss.item())
        for name, param in stage.model.named_parameters():
            assert param.dtype == torch.float32 and param.grad.dtype == torch.float32, (case, name)
            assert relative_error(full_tensor(param.grad), ref_grads[name]) < 5e-2, f"{case}: grad of {name}"


def _record_block_dtypes(stage: nn.Module) -> list[tuple[torch.dtype, torch.dtype]]:
    """(weight dtype, input dtype) of the first block at each of its forwards, after FSDP's own pre-forward."""
    seen = []
    block = next(iter(stage.model.blocks.values()))
    block.register_forward_pre_hook(lambda module, args: seen.append((module.attn.qkv.weight.dtype, args[0].dtype)))
    return seen


def _autocast():
    """What Fabric's bf16-mixed precision plugin enters around the step on CPU."""
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_bf16_mixed_precision_pipeline_is_close_to_fp32():
    run_distributed(mixed_precision_pipeline, 4)


# -- memory: measured at the peak against the planner -----------------------------------------------------


class _PeakMeter:
    """``SubsequenceHooks`` that record saved activations and sample the bytes of live tensors.

    Live bytes: every distinct storage of a tensor Python can reach (parameters, their gradients, FSDP's
    buffers, K/V caches, the pipeline's inputs and outputs), plus every saved tensor still alive. Sampled
    before each backward and, in the first backward (where dK/dV and gradients appear while every
    subsequence's activations are still held), at every ``UNPACK_STRIDE``-th saved tensor it unpacks.
    Temporaries inside one op are not seen (the planner counts them apart, as transients).
    """

    UNPACK_STRIDE = 8

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.saved: list[weakref.ref] = []
        self.saved_bytes = 0
        self.samples: list[tuple[int, int]] = []  # (live bytes, parameter bytes)
        self._seen: set[int] = set()
        self._unpacked: int | None = None  # counts unpacks during the first backward
        self._backwards = 0

    def begin_step(self, spans_) -> None:
        pass

    def end_step(self) -> None:
        pass

    def forward_context(self, key):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def after_forward(self, key) -> None:
        pass

    def before_backward(self, key) -> None:
        self.samples.append(_live_bytes(self.saved))
        self._unpacked = 0 if self._backwards == 0 else None

    def after_backward(self, key) -> None:
        self._backwards += 1
        self._unpacked = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if not _is_parameter(t) and storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.saved_bytes += storage.nbytes()
            self.saved.append(weakref.ref(t))
        return t

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        if self._unpacked is not None:
            self._unpacked += 1
            if self._unpacked % self.UNPACK_STRIDE == 0:
                self.samples.append(_live_bytes(self.saved))
        return t


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, a view of one (``weight.t()``) or a cast of one (RMSNorm's fp32 copy of a bf16 weight):
    counted with the weights, not the activations."""
    base = t._base if t._base is not None else t
    if isinstance(base, nn.Parameter):
        return True
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(type(f).__name__ == "AccumulateGrad" for f, _ in fn.next_functions if f is not None)


def _live_bytes(saved: list[weakref.ref]) -> tuple[int, int]:
    """(bytes of every distinct live storage, of those the parameters' own)."""
    storages: dict[int, int] = {}
    params: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch.distributed names warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    tensors += [p.grad for p in tensors if isinstance(p, nn.Parameter) and p.grad is not None]
    tensors += [t for t in (ref() for ref in saved) if t is not None]
    for t in tensors:
        local = t._local_tensor if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        if isinstance(t, nn.Parameter):
            params[storage.data_ptr()] = storage.nbytes()
    storages.pop(0, None)
    params.pop(0, None)
    return sum(storages.values()), sum(params.values())


MEMORY_CASES = [("bf16-mixed", "step"), ("bf16-mixed", "reduce"), ("bf16-mixed", "regather"), ("fp32", "regather")]
MEMORY_SEQ_LEN = 1024
MEMORY_N = 8


def measured_peak_matches_planner(rank: int, world_size: int, results: str) -> None:
    """dp=2 FSDP: per case, (predicted, measured) peak, parameter and saved bytes, written for the test."""
    core = _core(rank, world_size, 1, 1)
    config = GPTConfig.from_name("tiny-gqa")
    lengths = flops(MEMORY_SEQ_LEN, MEMORY_N, 64, config=config)
    ids, targets = make_batch(config, 1, MEMORY_SEQ_LEN, seed=rank)
    out = {}
    for precision, sync in MEMORY_CASES:
        bf16 = precision == "bf16-mixed"
        fsdp = FSDPOptions(param_dtype=torch.bfloat16 if bf16 else None, sync=sync)
        meter = _PeakMeter()
        stage, runtime = _stage(core, GPT(config), fsdp, hooks=meter)
        optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
        context = _autocast if bf16 else nullcontext
        runtime.step(ids, targets, StepPlan(lengths), forward_context=context)  # AdamW state exists from here on
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        meter.reset()
        runtime.step(ids, targets, StepPlan(lengths), forward_context=context)
        live, param_bytes = max(meter.samples)
        stage_plan = _predicted(config, lengths, precision, sync)
        memory = stage_plan.memory
        out[f"{precision}/{sync}"] = {
            "measured": live,
            "predicted": memory.resident_bytes,
            "measured_params": max(p for _, p in meter.samples),
            "predicted_params": memory.weights,
            "measured_saved": meter.saved_bytes,
            # everything the forward saves (memory.activations is level 2 at the step's peak, which may be a later
            # backward's, after earlier subsequences' activations are freed)
            "predicted_saved": stage_plan.offload.device_peak + memory.boundary,
        }
        del stage, runtime, optimizer
        gc.collect()
    torch.save(out, os.path.join(results, f"rank{rank}.pt"))


def _predicted(config: GPTConfig, lengths: list[int], precision: str, sync: str):
    layout = Layout(sp=1, pp=1, dp=2)
    costs = CostModel(config, precision_bytes(precision, sharded=True), UNLIMITED)
    evaluation = evaluate(
        costs, layout, placement(layout, 2), stage_specs(config, 1), lengths, Limits(2**50, 2**50),
        sync=sync, offloads=("none",),
    )  # fmt: skip
    return evaluation.stages[0]


def test_measured_peak_memory_matches_the_planner(tmp_path):
    """Peak within 10% (the planner adds every term at its own maximum), saved activations within 1%, and
    parameter bytes (fp32 shards + gathered weights): exact when the stage stays gathered for the step;
    with "regather" the planner counts the root and two blocks (FSDP prefetches the next block in backward),
    and a rank holds the root and at least one."""
    run_distributed(measured_peak_matches_planner, 2, str(tmp_path))
    config = GPTConfig.from_name("tiny-gqa")
    block = stage_parameter_counts(config, stage_specs(config, 1)[0]).block
    for rank in range(2):
        for case, m in torch.load(tmp_path / f"rank{rank}.pt").items():
            assert abs(m["predicted"] - m["measured"]) <= 0.10 * m["measured"], (rank, case, m)
            assert abs(m["predicted_saved"] - m["measured_saved"]) <= 0.01 * m["measured_saved"], (rank, case, m)
            if case.endswith("regather"):
                one_block = block * precision_bytes(case.split("/")[0], sharded=True).working
                assert m["predicted_params"] - one_block <= m["measured_params"] <= m["predicted_params"], (case, m)
            else:
                assert m["predicted_params"] == m["measured_params"], (rank, case, m)
