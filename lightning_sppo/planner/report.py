"""A plan as text for people: the layout, its memory and time, the runner-ups and what did not fit."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_sppo.planner.layer_time import GAP_TERMS
from lightning_sppo.planner.longest import Longest
from lightning_sppo.planner.plan import Plan
from lightning_sppo.planner.profile import host_share_per_gpu
from lightning_sppo.planner.units import format_bytes, format_tokens

__all__ = ["format_longest", "format_plan"]

_SHOWN_REJECTED = 5


def format_plan(plan: Plan) -> str:
    """Multi-line summary; ``--json`` carries every number."""
    world = plan.sp * plan.pp * plan.dp
    where = (
        "no pipeline" if plan.pp == 1 else "pipeline crosses nodes" if plan.pp_cross_node else "pipeline inside nodes"
    )
    lines = [
        f"sppo-plan: {plan.model}, {format_tokens(plan.seq_len)} tokens ({plan.seq_len}), {plan.nodes} node(s) x"
        f" {plan.gpus_per_node} {plan.profile}, {plan.precision}"
        + (", dK/dV in bf16 (lossy)" if plan.kv_grad_dtype == "bf16" else "")
        + (
            f", packed documents of {format_tokens(plan.document_length)} tokens (masked)"
            if plan.document_length is not None
            else ""
        ),
        "",
        f"layout        sp={plan.sp} pp={plan.pp} dp={plan.dp} ({world} GPUs; {where})",
        *_order_lines(plan),
        f"layers        {' '.join(map(str, plan.layers_per_stage))}",
        f"partition     {_abbreviated(plan.partition)} tokens",
        f"offload       {_offload(plan)}",
        _fsdp_line(plan),
        f"recompute     {plan.recompute}",
        f"K/V on device {_kv_place(plan)}",
        f"model state   {plan.model_state}"
        + (" (FSDP2 CPUOffloadPolicy; AdamW steps on the CPU)" if plan.model_state == "host" else ""),
        "",
        f"memory / GPU  {format_bytes(plan.peak_gpu_bytes)} of {format_bytes(plan.gpu_bytes)} HBM (stage"
        f" {plan.alpha_stage}); host {format_bytes(plan.peak_host_bytes)} of {format_bytes(plan.host_limit_bytes)}"
        f" ({_host_assumption(plan)})",
        "              " + _memory_terms(plan),
        "              " + _host_terms(plan),
        f"step          {plan.step_time_s:.2f} s{_sequences_per_step(plan)}, {plan.tokens_per_gpu_per_s:.0f} tokens/GPU/s,"
        f" MFU {plan.mfu:.1%}, bubble ratio {plan.bubble_ratio:.3f} (attention: {plan.attention_kernel})",
        "              " + _time_terms(plan),
        *_mfu_lines(plan),
    ]
    if plan.plain_ac is not None:
        lines.append(f"plain + AC    {_ac(plan)}")
    if plan.advice:
        lines.append(f"advice        {plan.advice}")
    if plan.other_schedules:
        lines += ["", "other schedules"] + [f"  {line}" for line in plan.other_schedules]
    if plan.runner_ups:
        lines += ["", "runner-ups"]
        lines += [
            f"  {r.schedule} sp={r.sp} pp={r.pp} dp={r.dp} N={r.num_subsequences}"
            f" {r.partition_policy}/{r.offload}/{r.fsdp_sync}/{r.recompute}/kv={_kv(r.kv_device_tokens)}/{r.model_state}:"
            f" {r.tokens_per_gpu_per_s:.0f} tokens/GPU/s, {format_bytes(r.peak_gpu_bytes)}; {r.why}"
            for r in plan.runner_ups
        ]
    if plan.rejected:
        lines += ["", f"did not fit ({len(plan.rejected)} layouts)"]
        lines += [f"  {line}" for line in plan.rejected[:_SHOWN_REJECTED]]
        if len(plan.rejected) > _SHOWN_REJECTED:
            lines.append(f"  ... {len(plan.rejected) - _SHOWN_REJECTED} more (--json lists all)")
    if plan.pruned:
        lines += ["", f"not evaluated  {plan.pruned} layouts: slower at every N left, by the cost model's lower bound"]
    return "\n".join(lines)


def format_longest(longest: Longest) -> str:
    """The longest length that fits, what it takes, then its plan."""
    plan = longest.plan
    after = (
        f"the model's block size {format_tokens(longest.limit)} stops it"
        if longest.limit is not None
        else f"{format_tokens(longest.seq_len + longest.granularity)} takes longer than --max-step-time"
        if longest.memory_seq_len is not None
        else f"{format_tokens(longest.seq_len + longest.granularity)} does not fit"
    )
    kv = _kv(plan.kv_device_tokens)
    lines = [
        f"longest sequence  {format_tokens(longest.seq_len)} tokens ({longest.seq_len}) at {plan.step_time_s:,.1f} s per"
        f" step; {after} (searched on multiples of {longest.granularity} tokens in {longest.seconds:.1f} s,"
        f" {len(longest.probes)} lengths tried)",
        f"with              {'order=layer, ' if plan.order == 'layer' else ''}sp={plan.sp} pp={plan.pp} dp={plan.dp},"
        f" N={plan.num_subsequences}, recompute={plan.recompute},"
        f" K/V on device={kv}, model state={plan.model_state}, offload={plan.offload}"
        + (f", fsdp_sync={plan.fsdp_sync}" if plan.order != "layer" else ""),
        f"memory            GPU {format_bytes(plan.peak_gpu_bytes)} of {format_bytes(plan.gpu_bytes)}; host"
        f" {format_bytes(plan.peak_host_bytes)} of {format_bytes(plan.host_limit_bytes)} per GPU",
        f"host assumption   {_host_assumption(plan)}",
        f"predicted         {plan.tokens_per_gpu_per_s:.0f} tokens/GPU/s, MFU {plan.mfu:.1%}, step {plan.step_time_s:.1f} s",
        *(
            [f"step time limit   {longest.max_step_time_s:g} s per step (--max-step-time): {_limit(longest)}"]
            if longest.max_step_time_s is not None
            else []
        ),
        "",
    ]
    return "\n".join(lines) + format_plan(plan)


def _limit(longest: Longest) -> str:
    if longest.memory_seq_len is None or longest.memory_seq_len == longest.seq_len:
        return "memory stops it first"
    return (
        f"memory would allow {format_tokens(longest.memory_seq_len)} tokens at {longest.memory_step_time_s:,.1f} s"
        " per step"
    )


def _ac(plan: Plan) -> str:
    """The plain model with full activation checkpointing on the same GPUs, scored by the same model."""
    ac = plan.plain_ac
    verdict = "fits" if ac["fits"] else "does not fit"
    ratio = ac["tokens_per_gpu_per_s"] / plan.tokens_per_gpu_per_s
    return (
        f"{ac['tokens_per_gpu_per_s']:.0f} tokens/GPU/s ({ratio:.2f}x this plan), {ac['step_time_s']:.2f} s per"
        f" sequence, {format_bytes(ac['peak_gpu_bytes'])} per GPU ({verdict}; attention: {ac['kernel']})"
    )


def _sequences_per_step(plan: Plan) -> str:
    """A dp-way plan trains dp sequences per step: say so, so that step times compare at equal work."""
    if plan.dp == 1:
        return ""
    return f" for {plan.dp} sequences (one per data-parallel replica; {plan.seconds_per_sequence:.2f} s each)"


def _kv(tokens: int | None) -> str:
    return "all" if tokens is None else format_tokens(tokens)


def _fsdp_line(plan: Plan) -> str:
    if plan.order == "layer" and (plan.sp * plan.dp > 1 or plan.model_state == "host"):
        return (
            "fsdp          order='layer': each block gathered once per layer pass (the next one ahead), its gradients"
            " reduce-scattered once"
        )
    return f"fsdp_sync     {plan.fsdp_sync}" + _fsdp_note(plan)


def _fsdp_note(plan: Plan) -> str:
    if plan.sp * plan.dp > 1:
        return ""
    return " (one-rank FSDP for the model state on host)" if plan.model_state == "host" else " (dp * sp = 1: no FSDP)"


def _kv_place(plan: Plan) -> str:
    if plan.kv_device_tokens is None:
        return "all (no spill)"
    return (
        f"{format_tokens(plan.kv_device_tokens)} tokens of each layer ({plan.kv_device_tokens}); the other"
        f" {format_tokens(plan.seq_len - plan.kv_device_tokens)} on host, streamed in chunks of"
        f" {format_tokens(plan.kv_chunk_tokens)}"
    )


def _host_assumption(plan: Plan) -> str:
    """The host memory the plan assumes: per node when known, and the share per GPU."""
    node = plan.host_bytes_per_node
    if not node or host_share_per_gpu(node, plan.gpus_per_node) != plan.host_limit_bytes:
        return "per GPU, as the profile gives it"
    return (
        f"7/8 of {format_bytes(plan.host_bytes_per_node)} host memory per node over {plan.gpus_per_node} GPUs,"
        " --host-memory"
    )


def _host_terms(plan: Plan) -> str:
    m = plan.memory
    return (
        f"host: offloaded activations {m.host / 2**30:.1f}, spilled K/V {m.host_kv / 2**30:.1f}, model state"
        f" {m.host_state / 2**30:.1f} GiB"
    )


def _order_lines(plan: Plan) -> list[str]:
    """How the GPUs run the sequence: the schedule of subsequences, or the layer order's chunks."""
    if plan.order == "layer":
        ulysses = f", each chunk split over the {plan.sp} SP ranks (Ulysses)" if plan.sp > 1 else ""
        return [
            f"order         layer: each layer over the whole sequence in {plan.num_subsequences} chunks before the next"
            f"{ulysses} (order='layer'; K/V of the running layer only, one chunk's dK/dV)"
        ]
    return [
        f"schedule      {plan.schedule}{_schedule_note(plan)}, {plan.num_microbatches} micro-batch"
        f" of {plan.num_subsequences} subsequences ({plan.partition_policy} partition)"
    ]


def _offload(plan: Plan) -> str:
    if plan.order == "layer":
        where = "on host but the last layer's" if plan.offload == "full" else "on the device"
        return f"{plan.offload}: what each layer keeps per chunk for its backward, {where}"
    return f"{plan.offload}; alpha of stage {plan.alpha_stage}: {_abbreviated(plan.alpha, '{:.2f}')}"


def _schedule_note(plan: Plan) -> str:
    if plan.schedule != "sppo":
        return ""
    if plan.pp == 1:
        return " (one stage: nothing to share, it runs as seq1f1b)"
    return " (multiplexed sequence partitioning: helpers stream the other stages' weights and K/V piece by piece)"


def _memory_terms(plan: Plan) -> str:
    m = plan.memory
    kv = (
        [("K/V + dK/dV at their peak", m.kv_cache)]
        if plan.order == "layer"
        else [("K/V", m.kv_cache), ("dK/dV", m.kv_grad)]
    )
    terms = [
        ("weights", m.weights), ("grads", m.gradients), ("AdamW", m.optimizer), *kv,
        ("activations", m.activations), ("boundary", m.boundary),
        ("transient", m.transient), ("reserved", m.reserved),
    ]  # fmt: skip
    if m.allocator_slack:
        terms.append(("allocator slack", m.allocator_slack))
    if m.kv_in_flight:
        terms.append(("K/V chunks in flight", m.kv_in_flight))
    if m.stream_bytes:
        terms += [("streamed weights", m.stream_weights), ("streamed K/V", m.stream_kv)]
    return ", ".join(f"{name} {value / 2**30:.1f}" for name, value in terms) + " GiB"


def _time_terms(plan: Plan) -> str:
    t = plan.time
    return (
        f"busiest stage: compute {t.compute:.2f} s, all-to-all {t.all_to_all:.2f} s, P2P {t.p2p:.2f} s,"
        f" offload waits {t.offload_wait:.2f} s, idle {t.idle:.2f} s, FSDP sync {t.sync:.2f} s"
        + (f", K/V copies {t.spill:.2f} s" if plan.kv_device_tokens is not None else "")
        + (f", CPU AdamW {t.optimizer:.2f} s" if plan.model_state == "host" else "")
        + (f", MSP traffic {t.shared:.2f} s" if plan.schedule == "sppo" else "")
    )


def _mfu_lines(plan: Plan) -> list[str]:
    """Order "layer": the MFU lost to each cause, in points of the peak (``Plan.mfu_terms``)."""
    if not plan.mfu_terms:
        return []
    lost = sorted(plan.mfu_terms.items(), key=lambda item: -item[1])
    terms = ", ".join(f"{GAP_TERMS[name]} {seconds / plan.step_time_s:.1%}" for name, seconds in lost)
    return [f"MFU lost      {1 - plan.mfu:.1%} of the peak: {terms}"]


def _abbreviated(values: Sequence, fmt: str = "{}", head: int = 6, tail: int = 2) -> str:
    items = [fmt.format(v) for v in values]
    if len(items) <= head + tail + 1:
        return " ".join(items)
    return " ".join(items[:head]) + f" ... ({len(items) - head - tail} more) ... " + " ".join(items[-tail:])
