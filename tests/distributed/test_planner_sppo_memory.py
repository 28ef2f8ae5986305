"""The planner's "sppo" replica bytes against what ``SharedUnits`` really holds, on gloo with real processes.

Under the "sppo" schedule every rank keeps an unsharded replica of every other stage (in the activation dtype),
its gradients, and per other stage a K/V cache pool for the whole sequence (``planner.multiplexed``). After
two steps each rank measures the replicas' parameter and gradient bytes and its replica pools' ``nbytes()``,
and compares them with ``MemoryBreakdown.replica_*`` of the same layout. Cases: pp=2 and pp=4 in fp32, pp=2
with bf16 dK/dV accumulators (``kv_grad_dtype``), and pp=2 x dp=2 under FSDP2 bf16 mixed precision (bf16
replicas). The workers call ``parallelize_gpt`` and ``PipelineRuntime`` directly, with the strategy core's mesh
and replica builder.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.parallel import parallelize_gpt
from lightning_sppo.parallel.fsdp import FSDPOptions
from lightning_sppo.partition import spans
from lightning_sppo.planner import CostModel, Layout, precision_bytes, stage_specs
from lightning_sppo.planner.evaluate import Limits, evaluate
from lightning_sppo.planner.layout import placement
from lightning_sppo.runtime.pipeline import PipelineRuntime
from lightning_sppo.strategy.config import SPPOConfig
from lightning_sppo.strategy.core import SPPOCore
from tests.conftest import make_batch
from tests.distributed.harness import run_distributed
from tests.planner.conftest import UNLIMITED

CPU = torch.device("cpu")
CONFIG = dict(name="tiny-gqa", n_layer=4)
SEQ_LEN = 1024
N = 4
ROWS = 1
TOLERANCE = 0.10
TERMS = ("weights", "grads", "kv")


def _autocast():
    """What Fabric's bf16-mixed precision plugin enters around the step on CPU."""
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _runtime(core: SPPOCore, config: GPTConfig, precision: str, kv_grad_dtype: str) -> PipelineRuntime:
    fsdp = FSDPOptions(param_dtype=torch.bfloat16 if precision == "bf16-mixed" else None)
    torch.manual_seed(0)  # every rank builds the same plain model
    stage = parallelize_gpt(GPT(config), core.dims, core.mesh, CPU, attention="sdpa", fsdp=fsdp)
    grad_dtype = torch.bfloat16 if kv_grad_dtype == "bf16" else None
    return PipelineRuntime(
        stage, core._groups(), "sppo", build_replica=core._replica_builder(config, CPU), kv_grad_dtype=grad_dtype
    )


def _measured(runtime: PipelineRuntime) -> dict[str, int]:
    """Bytes held by this rank's replicas of the other stages (``SharedUnits.modules``), and per stage's pool."""
    me = runtime.groups.pp_rank
    replicas = {stage: pair for stage, pair in runtime.shared.modules.items() if stage != me}
    params = [p for module, _ in replicas.values() for p in module.parameters()]
    return {
        "weights": sum(p.nbytes for p in params),
        "grads": sum(p.grad.nbytes for p in params if p.grad is not None),
        "kv": sum(pool.nbytes() for _, pool in replicas.values()),
        "pools_in_use": sum(pool.nbytes() > 0 for _, pool in replicas.values()),
        "replicas": len(replicas),
    }


def _predicted(config: GPTConfig, layout: Layout, rank: int, precision: str, kv_grad_dtype: str) -> dict[str, int]:
    dtypes = precision_bytes(precision, sharded=layout.dp * layout.sp > 1, kv_grad_dtype=kv_grad_dtype)
    evaluation = evaluate(
        CostModel(config, dtypes, UNLIMITED), layout, placement(layout, layout.world_size),
        stage_specs(config, layout.pp), [SEQ_LEN // N] * N, Limits(2**50, 2**50), batch=ROWS,
        offloads=("none",), schedule="sppo",
    )  # fmt: skip
    memory = evaluation.stages[rank].memory
    return {
        "weights": memory.replica_weights,
        "grads": memory.replica_grads,
        "kv": memory.replica_kv_cache + memory.replica_kv_grad,
    }


def replica_bytes_match_planner(
    rank: int, world_size: int, pp: int, precision: str, kv_grad_dtype: str, results: str
) -> None:
    """Two "sppo" steps, then this rank's replica bytes (measured after each step) and the planner's."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    core = SPPOCore(SPPOConfig(pipeline_parallel=pp, sequence_parallel=1, schedule="sppo"))
    core.set_world_size(world_size)
    core.build_mesh(CPU, rank, local_processes=world_size)
    config = GPTConfig.from_name(**CONFIG)
    runtime = _runtime(core, config, precision, kv_grad_dtype)
    dp_rank = core.dims.coordinates(rank)[1]
    ids, targets = make_batch(config, ROWS, SEQ_LEN, seed=dp_rank)
    context = _autocast if precision == "bf16-mixed" else nullcontext
    measured = []
    for _ in range(2):  # the second step reuses the first one's caches
        runtime.step(ids, targets, spans([SEQ_LEN // N] * N), forward_context=context)
        measured.append(_measured(runtime))
    pp_rank = core.dims.coordinates(rank)[0]
    predicted = _predicted(config, Layout(sp=1, pp=pp, dp=core.dims.dp), pp_rank, precision, kv_grad_dtype)
    torch.save({"measured": measured, "predicted": predicted}, f"{results}/rank{rank}.pt")


CASES = [
    pytest.param(2, 2, "fp32", "fp32", id="pp2-fp32"),
    pytest.param(4, 4, "fp32", "fp32", id="pp4-fp32"),
    pytest.param(2, 2, "fp32", "bf16", id="pp2-fp32-bf16-dkdv"),
    pytest.param(4, 2, "bf16-mixed", "fp32", id="pp2-dp2-bf16-mixed"),
]


@pytest.mark.parametrize(("world_size", "pp", "precision", "kv_grad_dtype"), CASES)
def test_replica_bytes_match_the_planner(tmp_path, world_size, pp, precision, kv_grad_dtype):
    """Every rank holds a replica and a filled cache pool of every other stage, allocated once; weights, grads and
    K/V + dK/dV of the replicas are each within 10% of the planner's. Negative control: leaving out the replica
    caches (what a seq1f1b-only model of memory would do) misses by more than 10%."""
    run_distributed(replica_bytes_match_planner, world_size, pp, precision, kv_grad_dtype, str(tmp_path))
    for rank in range(world_size):
        data = torch.load(tmp_path / f"rank{rank}.pt")
        first, second = data["measured"]
        predicted = data["predicted"]
        case = (rank, first, second, predicted)
        assert second["replicas"] == pp - 1 and second["pools_in_use"] == pp - 1, case  # helps every other stage
        assert first["kv"] == second["kv"], case  # the caches are allocated once and kept across steps
        for term in TERMS:
            assert second[term] > 0, case
            assert abs(predicted[term] - second[term]) <= TOLERANCE * second[term], (term, case)
        total = sum(second[term] for term in TERMS)
        without_caches = predicted["weights"] + predicted["grads"]
        assert abs(without_caches - total) > TOLERANCE * total, case
