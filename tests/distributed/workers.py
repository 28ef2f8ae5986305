"""Workers for the multi-process tests: each compares its rank's share against the plain model."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from lightning.fabric import Fabric

from lightning_sppo import GPT
from lightning_sppo.model.gpt import Block
from tests.conftest import (
    full_tensor,
    launch_fabric,
    make_batch,
    no_attribute_set,
    parity_config,
    plain_loss_and_grads,
    relative_error,
)

LR = 0.1
S = 48


def parity(
    rank: int, world_size: int, pp: int, dp: int, sp: int, cases: list[tuple], default_schedule: str = "seq1f1b"
) -> None:
    """Loss, every gradient, the global gradient norm and the parameters after a clipped SGD step equal the
    plain model's (relative error < 1e-5). A case is (N, micro-batches, partition[, offload policy[, settings]]),
    where ``settings`` is a dict of further strategy settings (e.g. ``{"recompute": "full"}``; a ``schedule`` there
    replaces ``default_schedule``, and ``model`` overrides fields of the tiny model's config, e.g. one K/V group)."""
    from lightning_sppo.offload import OffloadCallback

    batch_per_dp = 2
    for num_subsequences, num_microbatches, partition, *rest in cases:
        policy = rest[0] if rest else "none"
        settings = dict(rest[1]) if len(rest) > 1 else {}
        config = parity_config(gqa=True, **({"n_layer": max(2, pp)} | settings.pop("model", {})))
        case_schedule = settings.get("schedule", default_schedule)
        split = _RowSplitCounter() if case_schedule == "sppo" and pp > 1 else None
        replays = _ReplayCounter() if case_schedule == "sppo" and pp > 1 else None
        offload = policy if policy == "none" else OffloadCallback(policy, min_bytes=0)  # tiny tensors count
        torch.manual_seed(0)
        plain = GPT(config)
        ids, targets = make_batch(config, dp * batch_per_dp, S, seed=num_subsequences)
        ref_loss, ref_grads = plain_loss_and_grads(plain, ids, targets)

        layout = dict(pipeline_parallel=pp, sequence_parallel=sp, num_subsequences=num_subsequences)
        fabric = launch_fabric(
            world_size,
            **layout,
            num_microbatches=num_microbatches,
            partition=partition,
            offload=offload,
            **({"schedule": default_schedule} | settings),  # a case may name its own schedule
        )
        model = copy.deepcopy(plain)
        stage, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
        dp_rank = fabric.strategy.dims.coordinates(rank)[1]
        rows = slice(dp_rank * batch_per_dp, (dp_rank + 1) * batch_per_dp)
        with no_attribute_set(fabric.strategy.core.runtime):  # the runtime is told its plan: it sets nothing of its own
            loss = fabric.strategy.forward_backward(stage, ids[rows], targets[rows])

        case = (
            f"rank {rank} (pp={pp}, dp={dp}, sp={sp}) N={num_subsequences} M={num_microbatches} {partition}"
            f" {case_schedule} offload={policy} {settings}"
        )
        recompute = settings.get("recompute", "none")  # the stage's own blocks really recompute (and shared units')
        blocks = [m for m in stage.module.modules() if isinstance(m, Block)]
        assert blocks and all(getattr(b, "recompute", "none") == recompute for b in blocks), case
        if case_schedule == "sppo" and pp > 1:  # the shared units really ran, with helpers on other stages
            runtime = fabric.strategy.core.runtime
            shared = [a for a in runtime.actions(num_subsequences, num_microbatches) if a.multiplexed]
            assert shared and runtime.shared is not None, case
            # Units with fewer K/V groups (per SP rank) than members split their attention by query rows, others
            # by group: whichever this layout has really ran.
            groups = config.n_query_groups // sp
            assert (split.calls > 0) == any(len(a.group) > groups for a in shared), (case, split.calls)
            split.close()
            # The shared units' blocks recompute as the stage's own do: a first run without a graph, then in backward
            # the kept output ("selective") or the group's attention again ("full"); never a plain attention call.
            replays.close()
            kinds = {"none": {"plain"}, "selective": {"first", "kept"}, "full": {"first", "again"}}[recompute]
            assert set(replays.calls) == kinds, (case, replays.calls)
            if recompute != "none":
                assert replays.calls["first"] == sum(v for k, v in replays.calls.items() if k != "first"), case
        if policy != "none":  # the units a stage runs alone, and the shares of shared units, really went to host
            core = fabric.strategy.core
            alone = (
                sum(
                    1
                    for a in core.runtime.actions(num_subsequences, num_microbatches)
                    if a.op == "F" and not a.multiplexed
                )
                if core.runtime
                else 1
            )
            assert alone == 0 or core.hooks.last_stats.offloaded_bytes > 0, case
            if case_schedule == "sppo" and pp > 1:
                assert core.runtime.shared.hooks.last_stats.offloaded_bytes > 0, case
        if settings.get("model_state") == "host":  # FSDP2 keeps this stage's state on host, even unsharded
            from torch.distributed.fsdp import CPUOffloadPolicy

            from lightning_sppo.parallel.fsdp import fsdp_modules

            policies = [m._get_fsdp_state()._fsdp_param_group.offload_policy for m in fsdp_modules(stage.module)]
            assert policies and all(isinstance(p, CPUOffloadPolicy) for p in policies), case
        if settings.get("kv_device_tokens") is not None:  # the K/V beyond it really lived on host
            assert fabric.strategy.core.runtime.pool.host_nbytes() > 0, case
        lengths = fabric.strategy.core.last_plan.lengths
        assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (case, loss.item(), ref_loss.item())
        names = [name for name, _ in stage.module.named_parameters()]
        assert names, case
        for name, param in stage.module.named_parameters():
            err = relative_error(full_tensor(param.grad), ref_grads[name])
            assert err < 1e-5, f"{case} lengths={lengths}: grad of {name} off by {err}"
        check_clipped_sgd_step(fabric, stage, optimizer, plain, ref_grads, LR, case)


def check_clipped_sgd_step(fabric, stage, optimizer, plain: GPT, ref_grads: dict, lr: float, where) -> None:
    """Clip to half the global norm (every stage and shard must agree on the norm of the whole model), step SGD at
    ``lr``: the norm and every parameter after the step equal the plain model's (relative error < 1e-5)."""
    ref_norm = torch.stack([g.norm() for g in ref_grads.values()]).norm()
    norm = fabric.clip_gradients(stage, optimizer, max_norm=0.5 * ref_norm.item())
    assert abs(norm.item() - ref_norm.item()) / ref_norm.item() < 1e-5, (where, norm.item(), ref_norm.item())
    scale = 0.5 * ref_norm / (ref_norm + 1e-6)
    optimizer.step()
    plain_params = dict(plain.named_parameters())
    for name, param in stage.module.named_parameters():
        expected = plain_params[name].detach() - lr * scale * ref_grads[name]
        err = relative_error(full_tensor(param.detach()), expected)
        assert err < 1e-5, f"{where}: parameter {name} after SGD off by {err}"


class _RowSplitCounter:
    """Counts the row-split attentions this process runs (``parallel.multiplex.team_tasks`` calls) until closed."""

    def __init__(self) -> None:
        from lightning_sppo.parallel import multiplex

        self.calls, self._module, self._original = 0, multiplex, multiplex.team_tasks

        def counted(*args, **kwargs):
            self.calls += 1
            return self._original(*args, **kwargs)

        multiplex.team_tasks = counted

    def close(self) -> None:
        self._module.team_tasks = self._original


class _ReplayCounter:
    """Counts the shared units' attention calls of this process by kind until closed: "plain" (no recompute),
    "first" (a recomputing block's run without a graph), "kept" (its selective replay) or "again" (its full replay)."""

    def __init__(self) -> None:
        from collections import Counter

        from lightning_sppo.parallel.multiplex import UnitAttention

        self.calls, self._class, self._original = Counter(), UnitAttention, UnitAttention.attend

        def counted(unit, q, k, v, kernel, documents=None, replay=None):
            kind = "plain" if replay is None else "first" if replay.writes_cache else "kept" if replay.kept else "again"
            self.calls[kind] += 1
            return self._original(unit, q, k, v, kernel, documents, replay)

        UnitAttention.attend = counted

    def close(self) -> None:
        self._class.attend = self._original


def sppo_streaming_and_replay_fail_when_tampered(rank: int, world_size: int) -> None:
    """Negative controls for the "sppo" parity with selective recompute and K/V on host (pp=2): the same step is
    exact untouched; a helper's dK/dV of the owner's streamed prefix chunks never added to the owner's buffers, or a
    selective replay whose kept attention output is not the one forward computed, each break the gradients while the
    loss stays right. Every rank compares, and they decide together (no rank leaves a collective early)."""
    from lightning_sppo.parallel.multiplex import UnitAttention

    add_to_owner, attend = UnitAttention.add_to_owner, UnitAttention.attend

    def halved(unit, q, k, v, kernel, documents=None, replay=None):
        if replay is not None and replay.replaying and replay.kept is not None:
            replay.kept = (replay.kept[0] * 0.5, replay.kept[1])
        return attend(unit, q, k, v, kernel, documents, replay)

    tampers = {
        "untouched": {},
        "chunk dK/dV dropped": {"add_to_owner": lambda *args, **kwargs: None},
        "replayed output halved": {"attend": halved},
    }
    for what, patches in tampers.items():
        for name, patch in patches.items():
            setattr(UnitAttention, name, patch)  # this process only
        try:
            loss_error, worst = _sppo_errors(world_size, recompute="selective", kv_device_tokens=16, kv_chunk_tokens=8)
        finally:
            UnitAttention.add_to_owner, UnitAttention.attend = add_to_owner, attend
        assert loss_error < 1e-5, (rank, what, loss_error)  # forward untouched
        if what == "untouched":
            assert worst < 1e-5, (rank, what, worst)
        else:
            assert worst > 1e-3, f"parity held although the {what}: {worst}"


def _sppo_errors(world_size: int, **settings) -> tuple[float, float]:
    """pp=2 "sppo", N=4 flops: (the loss's relative error, the largest gradient error over every rank)."""
    config = parity_config(gqa=True, n_layer=2)
    torch.manual_seed(0)
    plain = GPT(config)
    ids, targets = make_batch(config, 2, S, seed=4)
    ref_loss, ref_grads = plain_loss_and_grads(plain, ids, targets)
    fabric = launch_fabric(
        world_size, pipeline_parallel=2, num_subsequences=4, partition="flops", schedule="sppo", **settings
    )
    stage = fabric.setup(copy.deepcopy(plain))
    loss = fabric.strategy.forward_backward(stage, ids, targets)
    assert fabric.strategy.core.runtime.pool.host_nbytes() > 0  # the prefix really streamed from host
    errors = [relative_error(full_tensor(p.grad), ref_grads[n]) for n, p in stage.module.named_parameters()]
    worst = torch.tensor(max(errors))
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    return abs(loss.item() - ref_loss.item()) / ref_loss.item(), worst.item()


def sppo_without_helper_gradients_fails(rank: int, world_size: int) -> None:
    """Negative controls for the "sppo" parity: an owner that never adds its group's weight gradients breaks it; so
    does, with one K/V group (attention split by query rows), a helper whose dK/dV contributions are dropped."""
    from lightning_sppo.parallel.multiplex import UnitAttention
    from lightning_sppo.runtime.streaming import PieceStream

    receive_grads = PieceStream.receive_grads
    PieceStream.receive_grads = lambda self, outgoing: outgoing.work.wait()  # this process only: nothing is added
    try:
        _expect_gradients_off(rank, world_size, [(2, 1, "length")], "the helpers' weight gradients never arrived")
    finally:
        PieceStream.receive_grads = receive_grads
    from_tasks = UnitAttention.from_tasks

    def drop(self, xs, spans, widths):  # rank 1 as a helper sends zeros for its dK/dV of the unit's tokens
        if rank == 1 and len(xs) == 2 and not self.is_owner:
            xs = [torch.zeros_like(x) for x in xs]
        return from_tasks(self, xs, spans, widths)

    UnitAttention.from_tasks = drop
    try:  # only stage 0's units lose K/V gradients: compare on every rank, decide together (no rank leaves early)
        config = parity_config(gqa=True, n_layer=2, n_query_groups=1)
        torch.manual_seed(0)
        plain = GPT(config)
        ids, targets = make_batch(config, 2, S, seed=4)
        ref_loss, ref_grads = plain_loss_and_grads(plain, ids, targets)
        fabric = launch_fabric(world_size, pipeline_parallel=2, num_subsequences=4, num_microbatches=2, schedule="sppo")
        stage = fabric.setup(copy.deepcopy(plain))
        split = _RowSplitCounter()
        loss = fabric.strategy.forward_backward(stage, ids, targets)
        split.close()
        assert split.calls > 0, rank
        assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5  # forward untouched
        errors = [relative_error(full_tensor(p.grad), ref_grads[n]) for n, p in stage.module.named_parameters()]
        worst = torch.tensor(max(errors))
        torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
        assert worst.item() > 1e-3, f"parity held although a helper's dK/dV contributions were dropped: {worst}"
    finally:
        UnitAttention.from_tasks = from_tasks


def _expect_gradients_off(rank: int, world_size: int, cases: list[tuple], what: str) -> None:
    """pp=2 "sppo" parity must fail on a gradient (the loss is right: only backward was tampered with)."""
    try:
        parity(rank, world_size, 2, 1, 1, cases, "sppo")
    except AssertionError as error:
        assert "grad of" in str(error), error
        return
    raise AssertionError(f"parity held although {what}")


def sppo_training_follows_plain_model(rank: int, world_size: int) -> None:
    """Three SGD steps with the "sppo" schedule (and full offload of the units a stage runs alone) land on the
    plain model's parameters: helpers pick up each step's new weights, caches are reused correctly."""
    config = parity_config(gqa=True, n_layer=2)
    torch.manual_seed(0)
    plain = GPT(config)
    model = copy.deepcopy(plain)
    fabric = launch_fabric(
        world_size, pipeline_parallel=2, num_subsequences=4, partition="flops", schedule="sppo", offload="full"
    )
    stage, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=LR)
    for step in range(3):
        ids, targets = make_batch(config, 2, S, seed=step)
        ref_loss, ref_grads = plain_loss_and_grads(plain, ids, targets)
        for name, p in plain.named_parameters():
            p.grad = ref_grads[name]
        plain_optimizer.step()
        loss = fabric.strategy.forward_backward(stage, ids, targets)
        optimizer.step()
        optimizer.zero_grad()
        assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (rank, step, loss.item(), ref_loss.item())
    expected = dict(plain.named_parameters())
    for name, param in stage.module.named_parameters():
        err = relative_error(full_tensor(param.detach()), expected[name].detach())
        assert err < 1e-5, f"rank {rank}: {name} off by {err} after 3 steps"


def bf16_kv_gradients(rank: int, world_size: int) -> None:
    """kv_grad_dtype="bf16" reaches the stage's caches, which shared units stream dK/dV from and add into; gradients
    stay close to the plain model's, but not within fp32's 1e-5."""
    config = parity_config(gqa=True, n_layer=2)
    torch.manual_seed(0)
    plain = GPT(config)
    ids, targets = make_batch(config, 2, S, seed=0)
    ref_loss, ref_grads = plain_loss_and_grads(plain, ids, targets)
    fabric = launch_fabric(world_size, pipeline_parallel=2, num_subsequences=6, schedule="sppo", kv_grad_dtype="bf16")
    stage = fabric.setup(copy.deepcopy(plain))
    loss = fabric.strategy.forward_backward(stage, ids, targets)
    runtime = fabric.strategy.core.runtime
    caches = runtime.pool.caches()
    assert caches and runtime.shared is not None, rank
    assert {cache.grad_buffers()[0].dtype for cache in caches} == {torch.bfloat16}, rank
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5  # forward does not touch dK/dV
    errors = {name: relative_error(full_tensor(p.grad), ref_grads[name]) for name, p in stage.module.named_parameters()}
    assert max(errors.values()) < 2e-2, (rank, errors)
    assert max(errors.values()) > 1e-5, (rank, errors)  # bf16 sums really ran: not fp32-exact


def checkpoint_round_trip(rank: int, world_size: int, tmp: str) -> None:
    """Save in one layout (pp=2) after a step, load into another (dp=2, FSDP): weights and AdamW state
    match; a single-file export has exactly the plain GPT's keys and loads into the plain model."""
    config = parity_config(gqa=True, n_layer=2)
    torch.manual_seed(0)
    plain = GPT(config)
    ids, targets = make_batch(config, 2, S)

    fabric = launch_fabric(world_size, pipeline_parallel=2, num_subsequences=2)
    stage, optimizer = _setup(fabric, copy.deepcopy(plain))
    fabric.strategy.forward_backward(stage, ids, targets)
    optimizer.step()
    mine = {n: (p.detach().clone(), optimizer.state[p]["exp_avg"].clone()) for n, p in stage.module.named_parameters()}
    torch.save(mine, Path(tmp) / f"rank{rank}.pt")
    fabric.save(Path(tmp) / "sharded", {"model": stage, "optimizer": optimizer, "step": 7})
    expected = {}
    for r in range(world_size):
        expected |= torch.load(Path(tmp) / f"rank{r}.pt")

    fabric2 = launch_fabric(world_size, pipeline_parallel=1, num_subsequences=2, save_distributed_checkpoint=False)
    stage2 = fabric2.setup_module(GPT(config))  # fresh weights, replaced by the load
    optimizer2 = fabric2.setup_optimizers(torch.optim.AdamW(stage2.parameters(), lr=1e-3))
    state = {"model": stage2, "optimizer": optimizer2, "step": 0}
    fabric2.load(Path(tmp) / "sharded", state)
    assert state["step"] == 7
    assert set(dict(stage2.module.named_parameters())) == set(expected)
    for name, param in stage2.module.named_parameters():
        weight, exp_avg = expected[name]
        assert torch.equal(full_tensor(param.detach()), weight), f"rank {rank}: {name} differs after load"
        assert torch.equal(full_tensor(optimizer2.state[param]["exp_avg"]), exp_avg), f"rank {rank}: exp_avg of {name}"

    fabric2.save(Path(tmp) / "single.pt", {"model": stage2, "optimizer": optimizer2, "step": 8})
    if rank == 0:
        exported = torch.load(Path(tmp) / "single.pt", weights_only=False)
        assert set(exported["model"]) == set(plain.state_dict()), sorted(set(exported["model"]) ^ set(expected))
        for name, value in exported["model"].items():
            assert torch.equal(value, expected[name][0]), name
        assert exported["step"] == 8
        assert set(exported["optimizer"]["state"]) == set(expected)
        GPT(config).load_state_dict(exported["model"])  # loads anywhere, into the plain model

    fabric3 = launch_fabric(world_size, pipeline_parallel=2, num_subsequences=2)  # the file back into pp=2
    stage3, optimizer3 = _setup(fabric3, GPT(config))
    fabric3.load(Path(tmp) / "single.pt", {"model": stage3, "optimizer": optimizer3})
    for name, param in stage3.module.named_parameters():
        assert torch.equal(param.detach(), expected[name][0]), f"rank {rank}: {name} differs after file load"
        assert torch.equal(optimizer3.state[param]["exp_avg"], expected[name][1]), name


def _setup(fabric: Fabric, model: GPT):
    return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def fsdp_communication_counts(rank: int, world_size: int) -> None:
    """With N subsequences, FSDP gathers each sharded module's weights once per step and reduce-scatters
    its gradients once, after the step's last backward (not once per subsequence)."""
    import torch.distributed as dist

    from lightning_sppo.parallel.fsdp import fsdp_modules

    counts = {"all_gather_single": 0, "reduce_scatter_single": 0}
    for name in counts:
        original = getattr(dist, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
    config = parity_config(gqa=True, n_layer=2)
    fabric = launch_fabric(world_size, num_subsequences=4)  # dp=2: FSDP over 2 ranks
    stage, optimizer = _setup(fabric, GPT(config))
    modules = len(fsdp_modules(stage._forward_module))
    ids, targets = make_batch(config, 2, S)
    for step in range(2):
        counts.update(all_gather_single=0, reduce_scatter_single=0)
        fabric.strategy.forward_backward(stage, ids[rank : rank + 1], targets[rank : rank + 1])
        optimizer.step()
        assert counts == {"all_gather_single": modules, "reduce_scatter_single": modules}, (step, counts, modules)


def offload_bit_identical(rank: int, world_size: int) -> None:
    """With a pipeline, each stage offloads its own subsequences: gradients bit-identical to no offload."""
    from lightning_sppo.offload import OffloadCallback

    config = parity_config(gqa=True, n_layer=2)
    ids, targets = make_batch(config, 2, S)
    grads = {}
    for policy in ("none", "full", "adaptive"):
        torch.manual_seed(0)
        offload = policy if policy == "none" else OffloadCallback(policy, min_bytes=0)  # tiny tensors count
        fabric = launch_fabric(world_size, pipeline_parallel=2, num_subsequences=4, num_microbatches=2, offload=offload)
        stage = fabric.setup(GPT(config))
        fabric.strategy.forward_backward(stage, ids, targets)
        grads[policy] = {n: p.grad.clone() for n, p in stage.module.named_parameters()}
        if policy != "none":
            assert fabric.strategy.core.hooks.last_stats.offloaded_bytes > 0, (rank, policy)
    for policy in ("full", "adaptive"):
        for name, grad in grads["none"].items():
            assert torch.equal(grad, grads[policy][name]), (rank, policy, name)


def evaluate_parity(rank: int, world_size: int, cases: list[tuple[int, int, int, str, int]]) -> None:
    """For each (pp, dp, sp, schedule, micro-batches): the forward-only pass gives the plain model's summed
    loss and target count over the global batch on every rank, and the training step after it still gives
    the plain model's loss and gradients (caches and FSDP weights were left as training expects them)."""
    for pp, dp, sp, schedule, microbatches in cases:
        _evaluate_case(rank, world_size, pp, dp, sp, schedule, microbatches)


def _evaluate_case(rank: int, world_size: int, pp: int, dp: int, sp: int, schedule: str, microbatches: int) -> None:
    config = parity_config(gqa=True, n_layer=max(2, pp))
    torch.manual_seed(0)
    plain = GPT(config)
    batch_per_dp = 2
    ids, targets = make_batch(config, dp * batch_per_dp, S, seed=3)
    with torch.no_grad():
        logits = plain(ids)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    fabric = launch_fabric(
        world_size, pipeline_parallel=pp, sequence_parallel=sp, num_subsequences=3, partition="flops",
        num_microbatches=microbatches, schedule=schedule,
    )  # fmt: skip
    stage = fabric.setup(copy.deepcopy(plain))
    dp_rank = fabric.strategy.dims.coordinates(rank)[1]
    rows = slice(dp_rank * batch_per_dp, (dp_rank + 1) * batch_per_dp)
    case = f"rank {rank} (pp={pp}, dp={dp}, sp={sp}) {schedule} M={microbatches}"
    with torch.inference_mode():  # as Lightning's validation loop may call it
        total, count = fabric.strategy.evaluate(stage, ids[rows], targets[rows])
    assert count.item() == (targets != -100).sum().item(), (case, count.item())
    assert abs(total.item() - expected.item()) / expected.item() < 1e-5, (case, total.item(), expected.item())

    ref_loss, ref_grads = plain_loss_and_grads(plain, ids, targets)
    loss = fabric.strategy.forward_backward(stage, ids[rows], targets[rows])
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5, (case, loss.item(), ref_loss.item())
    for name, param in stage.module.named_parameters():
        err = relative_error(full_tensor(param.grad), ref_grads[name])
        assert err < 1e-5, f"{case}: grad of {name} after evaluate off by {err}"
