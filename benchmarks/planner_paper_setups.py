"""The planner on the SPPO paper's setups (Table 4), next to the paper's choices.

For each model, GPU count and sequence length of the paper's Table 4 it runs ``solve`` (what ``sppo-plan``
prints) and ``assess_layout`` on the paper's own (SP, PP, N), under:

* the paper's testbed (section 7): A100-80GB, 8 per node, 2 TB host memory per node, 32 GB/s between GPU and
  host, four 200 Gb/s HDR NICs per node (12.5 GB/s per GPU, 90% effective);
* and, for reference, the built-in ``h200`` profile;
both with precision ``bf16-mixed`` as the runtime applies it (FSDP2 mixed precision on sharded stages, see
``lightning_sppo.planner.precision``), every FSDP sync mode (``parallel/fsdp.py``) and both schedules (seq1f1b,
and sppo: Seq1F1B with multiplexed sequence partitioning, its weights and K/V streamed per layer) open to the solver,
exact fp32 dK/dV accumulation. Each row also gives sppo against seq1f1b on the chosen layout (memory and predicted
speed-up, communication counted) next to the paper's MSP speed-up, and the GPT-65B 1024K setup on the A100 testbed
gets an extra row with the lossy opt-in ``--kv-grad-dtype=bf16``.

Every row also gives the layer order's best plan (``order="layer"``: FPDT's order, one stage, Ulysses over sp ranks,
FSDP2 over dp x sp, ``planner.layer_plan``) beside the plan ``sppo-plan`` picks from both orders. A second table plans
FPDT's own setups (Yao et al., Llama-3 8B: 2M tokens on 4 A100-80GB, 4M on 8) on FPDT's testbed as its paper gives
it, beside the MFU it reports.

Predictions only (no GPU runs): times come from the planner's cost model, not measurements.

Run:  python benchmarks/planner_paper_setups.py        # writes benchmarks/results/planner_paper_setups.{md,json}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from lightning_sppo import GPTConfig
from lightning_sppo.planner import BUILTIN_PROFILES, NoFeasiblePlan, PlanRequest, assess_layout, solve
from lightning_sppo.planner.profile import with_host_memory
from lightning_sppo.planner.units import format_bytes

K = 1024

# SPPO paper, Table 4 ("Configurations for various GPT models"), the "Mega. & SPPO" columns: SP and PP per
# model, N per sequence length. (The "Mega. Tune" columns are SP=32 PP=1, SP=8 PP=8, SP=64 PP=2.)
PAPER_TABLE_4 = [
    ("gpt-7b", 32, 8, 4, [(512 * K, 32), (640 * K, 64), (768 * K, 80), (896 * K, 128), (1024 * K, 160)]),
    ("gpt-13b", 64, 8, 8, [(512 * K, 32), (640 * K, 48), (768 * K, 64), (1024 * K, 80), (1280 * K, 160)]),
    ("gpt-65b", 128, 16, 8, [(512 * K, 32), (600 * K, 64), (640 * K, 80), (768 * K, 96), (1024 * K, 128)]),
]

# Paper, section 7 "Testbed": 8 A100-80GB per server, 2 TB host memory per node, GPU-CPU bandwidth 32 GB/s,
# four 200 Gbps HDR InfiniBand per node (100 GB/s per node: 12.5 GB/s per GPU, taken at 90%).
TESTBED = replace(
    BUILTIN_PROFILES["a100-80gb"], name="a100-80gb (SPPO testbed)", d2h_gbps=32.0, h2d_gbps=32.0,
    inter_node_gbps=12.5 * 0.9,
)  # fmt: skip

RUNS = [
    ("A100-80GB testbed, bf16-mixed", TESTBED, "bf16-mixed"),
    ("H200 (built-in profile), bf16-mixed", BUILTIN_PROFILES["h200"], "bf16-mixed"),
]

# FPDT paper (Yao et al.), section 5.1: nodes of four A100-80GB on third-generation NVLink, PCIe at 32 GB/s each way,
# 1 TB of host memory per node, 200 Gb/s HDR InfiniBand between nodes (one NIC per node assumed: 25 GB/s over four
# GPUs, taken at 90%).
FPDT_TESTBED = with_host_memory(
    replace(
        BUILTIN_PROFILES["a100-80gb"], name="a100-80gb (FPDT testbed)", gpus_per_node=4, d2h_gbps=32.0, h2d_gbps=32.0,
        inter_node_gbps=25.0 / 4 * 0.9,
    ),
    2**40,
)  # fmt: skip
FPDT_SETUPS = [("llama-3.1-8b", 4, 2 * K * K, "> 55% (Fig. 11)"), ("llama-3.1-8b", 8, 4 * K * K, "55.7% (Table 3)")]
"""(model, GPUs, tokens, FPDT's reported MFU): its Llama-3 8B headlines (Llama-3.1-8B has its shapes)."""

LOSSY_ROWS = {("A100-80GB testbed, bf16-mixed", "gpt-65b", 1024 * K)}
"""Setups planned a second time with ``--kv-grad-dtype=bf16`` (dK/dV accumulated in bf16: lossy)."""


def plan_row(
    model: str, gpus: int, seq_len: int, paper: tuple[int, int, int], profile, precision: str, kv_grad: str = "fp32"
) -> dict:
    """Our plan, what sppo would need on its layout, and the paper's layout under our model, for one setup."""
    config = GPTConfig.from_name(model)
    request = PlanRequest(
        config=config, seq_len=seq_len, nodes=gpus // profile.gpus_per_node, profile=profile, precision=precision,
        kv_grad_dtype=kv_grad,
    )  # fmt: skip
    row = {"model": model, "gpus": gpus, "seq_len": seq_len, "paper": dict(zip(("sp", "pp", "n"), paper, strict=True))}
    row["kv_grad_dtype"] = kv_grad
    start = time.perf_counter()
    try:
        plan = solve(request)
        row["plan"] = {k: v for k, v in plan.to_dict().items() if k not in ("partition", "alpha_by_stage", "rejected")}
    except NoFeasiblePlan as error:
        row["plan"] = None
        row["no_fit"] = {"limit": error.limit, "overflow_bytes": error.overflow_bytes, "message": str(error)}
    row["planning_s"] = time.perf_counter() - start
    row["layer_order"] = layer_order_row(request)
    row["paper_layout"] = asdict(assess_layout(request, *paper))
    row["sppo_on_layout"] = _sppo_on_layout(request, row["plan"])
    row["ours_over_paper"] = ours_over_paper(row)
    return row


def layer_order_row(request: PlanRequest) -> dict:
    """The layer order's fastest plan for ``request`` (``--order layer``), or why it has none."""
    try:
        plan = solve(replace(request, order=("layer",), compare_ac=False))
    except NoFeasiblePlan as error:
        return {"plan": None, "message": str(error)}
    keys = ("sp", "dp", "num_subsequences", "recompute", "offload", "model_state", "kv_device_tokens", "peak_gpu_bytes",
            "peak_host_bytes", "step_time_s", "seconds_per_sequence", "tokens_per_gpu_per_s", "mfu", "mfu_terms")  # fmt: skip
    return {"plan": {k: v for k, v in plan.to_dict().items() if k in keys}}


def _layer_order(row: dict) -> str:
    layered = row["layer_order"]["plan"]
    if layered is None:
        return "no fit"
    return (
        f"{layered['sp']}/1/{layered['dp']}/{layered['num_subsequences']} {layered['recompute']},"
        f" {layered['offload']}, state {layered['model_state']}: {layered['tokens_per_gpu_per_s']:.1f} tok/GPU/s,"
        f" {layered['mfu']:.0%}"
    )


PAPER_MSP_SPEEDUP = {"gpt-13b": 1.44, "gpt-65b": 3.48}
"""SPPO paper, section 7.2: multiplexed sequence partitioning's speed-up over SPPO without it."""


def _sppo_on_layout(request: PlanRequest, plan: dict | None) -> dict | None:
    """Both schedules on the plan's own (sp, pp, N, partition): whether sppo fits, its peak memory, and its speed-up
    over seq1f1b there (the ratio of predicted step times, communication counted)."""
    if plan is None or plan["pp"] == 1:
        return None
    layout = (plan["sp"], plan["pp"], plan["num_subsequences"], plan["partition_policy"])
    sppo = asdict(assess_layout(replace(request, schedule=("sppo",)), *layout))
    plain = asdict(assess_layout(replace(request, schedule=("seq1f1b",)), *layout))
    sppo["seq1f1b_peak_gpu_bytes"] = plain["peak_gpu_bytes"]
    sppo["seq1f1b_step_time_s"] = plain["step_time_s"]
    sppo["seq1f1b_bubble_ratio"] = plain["bubble_ratio"]
    both = sppo["feasible"] and plain["feasible"]
    sppo["speedup"] = plain["step_time_s"] / sppo["step_time_s"] if both else None
    return sppo


def _ours(row: dict) -> list[str]:
    plan = row["plan"]
    if plan is None:
        return [f"no fit ({row['no_fit']['limit']} +{format_bytes(row['no_fit']['overflow_bytes'])})"] + ["-"] * 8
    layout = f"{plan['sp']}/{plan['pp']}/{plan['dp']}/{plan['num_subsequences']}"
    sync = "FSDP per layer pass" if plan["order"] == "layer" else plan["fsdp_sync"]
    return [
        f"{layout} {plan['partition_policy']}, {plan['offload']}, {sync}, {plan['recompute']}",
        "layer" if plan["order"] == "layer" else plan["schedule"],
        format_bytes(plan["peak_gpu_bytes"]),
        format_bytes(plan["peak_host_bytes"]),
        f"{plan['step_time_s']:.0f} ({plan['step_time_s'] / plan['dp']:.0f})",
        f"{plan['tokens_per_gpu_per_s']:.1f}",
        f"{plan['mfu']:.0%}",
        f"{plan['bubble_ratio']:.2f}",
        _ours_over_paper(row),
    ]


def ours_over_paper(row: dict) -> float | None:
    """Our plan's predicted tokens/GPU/s over the paper's layout's, both under our model (None: one does not fit)."""
    paper = row["paper_layout"]
    if row["plan"] is None or not paper["feasible"]:
        return None
    return row["plan"]["tokens_per_gpu_per_s"] / paper["tokens_per_gpu_per_s"]


def _ours_over_paper(row: dict) -> str:
    ratio = ours_over_paper(row)
    if ratio is not None:
        return f"**{ratio:.2f}**"
    return "paper's does not fit" if row["plan"] is not None else "-"


def _paper_layout(row: dict) -> str:
    a = row["paper_layout"]
    if a["feasible"]:
        return (
            f"fits ({a['schedule']}, {a['offload']}, {a['fsdp_sync']}): {format_bytes(a['peak_gpu_bytes'])},"
            f" {a['tokens_per_gpu_per_s']:.0f} tok/GPU/s"
        )
    return f"no fit: {format_bytes(a['peak_gpu_bytes'])} GPU, {format_bytes(a['peak_host_bytes'])} host"


def _sppo_needs(row: dict) -> str:
    a = row["sppo_on_layout"]
    if a is None:
        return "-"
    more = a["peak_gpu_bytes"] / a["seq1f1b_peak_gpu_bytes"] - 1
    if not a["feasible"]:
        return f"no fit: {format_bytes(a['peak_gpu_bytes'])} GPU ({more:+.0%})"
    speed = f", **{a['speedup']:.2f}x**" if a["speedup"] is not None else ""
    bubbles = f", bubble {a['seq1f1b_bubble_ratio']:.2f} -> {a['bubble_ratio']:.2f}" if a["speedup"] else ""
    return f"fits: {format_bytes(a['peak_gpu_bytes'])} ({more:+.0%}){speed}{bubbles}"


def _paper_speedup(row: dict) -> str:
    return f"{PAPER_MSP_SPEEDUP[row['model']]:.2f}x" if row["model"] in PAPER_MSP_SPEEDUP else "-"


def _setup(row: dict) -> str:
    seq = f"{row['seq_len'] // K}K"
    return seq if row["kv_grad_dtype"] == "fp32" else f"{seq}, **bf16 dK/dV (lossy)**"


def markdown(title: str, rows: list[dict]) -> str:
    head = ["model", "GPUs", "S", "paper SP/PP/N", "ours SP/PP/DP/N", "schedule (or order)", "peak GPU", "peak host",
            "step s (per sequence)", "tok/GPU/s", "MFU", "bubble", "ours / paper's layout (tok/GPU/s)",
            "sppo on our layout (vs seq1f1b there)", "paper's MSP speed-up", "paper's layout under our model",
            "layer order's best SP/PP/DP/N", "plan s"]  # fmt: skip
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        p = r["paper"]
        cells = [r["model"], str(r["gpus"]), _setup(r), f"{p['sp']}/{p['pp']}/{p['n']}"]
        cells += _ours(r) + [_sppo_needs(r), _paper_speedup(r), _paper_layout(r), _layer_order(r)]
        cells.append(f"{r['planning_s']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    reasons = [f"- {r['model']} at {_setup(r)}: {r['no_fit']['message']}" for r in rows if r["plan"] is None]
    if reasons:
        lines += ["", "Why the rows without a plan do not fit (the planner's message):", "", *reasons]
    return "\n".join(lines)


NOTES = [
    "ours SP/PP/DP/N: the layout `sppo-plan` picks (one micro-batch), then its partition policy (flops = equal"
    " FLOPs, the paper's; length when flops does not fit), offload policy and FSDP sync mode (step: weights gathered"
    " and gradients reduced once per step; reduce: gradients reduce-scattered after every subsequence; regather:"
    " weights gathered for every pass too). tok/GPU/s and MFU are predictions of the cost model (per-layer FLOPs at"
    " the profile's peak x mfu, plus all-to-all, P2P, exposed FSDP traffic and exposed copies, timed by the schedule"
    " simulator on the chosen schedule's action lists).",
    "schedule: the solver searches seq1f1b and sppo (Seq1F1B with multiplexed sequence partitioning, SPPO section"
    " 6.2, as runtime/multiplexed.py runs it) and keeps the fastest that fits. `sppo on our layout` evaluates both"
    " schedules on the chosen SP/PP/N and partition: sppo's peak GPU memory (and how much more than seq1f1b's on the"
    " same layout), and its predicted speed-up over seq1f1b there (seq1f1b's step time / sppo's), with the"
    " communication counted: each helper streams the owner's weights one piece (embedding, block, head) at a time"
    " in FSDP's chunk layout and returns each piece's gradient, attention is split by K/V group across the group"
    " with each helper's prefix K/V streamed from the owner's cache per layer (and, in backward, K/V, the owner's"
    " dK/dV and the prefix dK/dV back), and every member of a group waits for the group's collectives."
    " `paper's MSP speed-up` is section 7.2's figure for MSP over SPPO without it. Where the pipeline crosses nodes"
    " (12.5 GB/s per GPU here, against NVLink inside a node) a shared unit's traffic (a piece's weights per layer,"
    " the prefix K/V of late subsequences) exceeds the compute it takes off its owner, and every rank takes part in"
    " about pp^2/2 shared units per step: the prediction is a slow-down, not the paper's speed-up.",
    "no fit (gpu +X): the closest layout needs X more than the device has (after a 4 GiB reserve); the planner's"
    " one-line reason is listed under the table (it also says how far sppo is, and whether the lossy bf16 dK/dV"
    " would fit). `paper's layout under our model` evaluates the paper's SP/PP/N with the flops partition, both"
    " schedules, the fastest sync mode and the first offload policy that fits (full if none), and names the"
    " schedule when it fits.",
    'bf16 dK/dV (lossy): the row planned with `--kv-grad-dtype=bf16` (the runtime\'s opt-in `kv_grad_dtype="bf16"`):'
    " the dK/dV accumulators take 2 bytes per element instead of 4, and their sums over later subsequences round"
    " in bf16, an error that grows with N (benchmarks/kv_grad_precision.py measures it). Every other row uses exact"
    " fp32 accumulation.",
    "What the planner models (the runtime as this version runs it, checked on CPU against measured bytes in"
    " tests/planner, tests/distributed/test_fsdp_options.py and tests/distributed/test_planner_sppo_memory.py, where"
    " a helper's streamed weights and K/V are measured on gloo within 10% of the planner's): FSDP2"
    " mixed precision on sharded stages (bf16 gathered weights, fp32 master shards, fp32 gradients accumulated"
    " unsharded between backwards under sync=step), bf16 activations and pipeline messages, and level 1 = the bf16"
    " K/V cache plus fp32 dK/dV buffers for the whole sequence (3x the bytes of the paper's bf16 K/V; exact"
    " gradients need the fp32 accumulation; 2x with bf16 dK/dV). Pipeline messages are in the stage's compute dtype"
    " (bf16 when sharded).",
    "ours / paper's layout: the plan's predicted tokens/GPU/s over those of the paper's SP/PP/N under the same"
    " model (the paper's layout is assessed with the flops partition and its best schedule, offload, sync mode,"
    " recompute and K/V placement). The solver searches every (SP, PP) the runtime accepts (SP"
    " inside a node or over whole nodes, as the paper's GPT-65B SP=16) and N from 16K tokens per device down to the"
    " cost model's shortest (where a layer's fixed cost per pass, launches plus the read of its weights from HBM,"
    " reaches a quarter of its matmul time), on a grid of round values that holds every N of the paper's Table 4.",
    "step s (per sequence): a plan with dp > 1 trains dp sequences per step (one per data-parallel replica); the"
    " time per sequence is the step over dp, comparable with a dp = 1 layout's step.",
    "schedule (or order) and `layer order's best`: `sppo-plan` plans both orders of a step at every layout and keeps"
    " the faster per sequence; `layer` in the schedule column is the layer order (FPDT's: each layer over the whole"
    " sequence in chunks, one stage, Ulysses over sp ranks, FSDP2 over dp x sp, what each layer keeps on host with"
    " offload full, K/V streamed from host beyond R; runtime/layer_major.py), and the last column its fastest plan"
    " whichever order won (SP/PP/DP/N, recompute, offload, where the model state lives, tokens/GPU/s, MFU).",
    "FPDT's setups: Llama-3 8B (Llama-3.1-8B's shapes) at 2M tokens on 4 A100-80GB and 4M on 8, on FPDT's testbed"
    " (section 5.1: four A100-80GB per node, PCIe 32 GB/s, 1 TB host memory per node, 200 Gb/s HDR between nodes);"
    " `MFU lost` splits the layer order's distance from the peak into the planner's causes (planner/layer_time.py"
    " GAP_TERMS: attention kernels below peak, the recomputed forward work, the head and loss, elementwise kernels"
    " and host ops, block GEMMs below peak, all-to-alls, host copies and FSDP traffic not hidden, the optimizer);"
    " they and the MFU sum to 100%.",
]


def fpdt_row(model: str, gpus: int, seq_len: int, reported: str) -> dict:
    """One of FPDT's setups on its testbed: the plan ``sppo-plan`` picks, and each order's best."""
    profile, config = FPDT_TESTBED, GPTConfig.from_name(model)
    request = PlanRequest(
        config=replace(config, block_size=max(config.block_size, seq_len)), seq_len=seq_len, nodes=gpus // profile.gpus_per_node, profile=profile,
        compare_ac=False,
    )  # fmt: skip
    row = {"model": model, "gpus": gpus, "seq_len": seq_len, "fpdt_mfu": reported}
    start = time.perf_counter()
    try:
        plan = solve(request)
        keys = ("order", "sp", "pp", "dp", "num_subsequences", "recompute", "offload", "model_state", "schedule",
                "peak_gpu_bytes", "peak_host_bytes", "step_time_s", "tokens_per_gpu_per_s", "mfu", "mfu_terms",
                "other_schedules")  # fmt: skip
        row["plan"] = {k: v for k, v in plan.to_dict().items() if k in keys}
    except NoFeasiblePlan as error:
        row["plan"], row["no_fit"] = None, str(error)
    row["planning_s"] = time.perf_counter() - start
    row["layer_order"] = layer_order_row(request)
    return row


def fpdt_markdown(rows: list[dict]) -> str:
    head = ["model", "GPUs", "S", "plan (order, SP/PP/DP/N, recompute, offload, model state)", "peak GPU", "peak host",
            "tok/GPU/s", "MFU", "FPDT reports", "MFU lost, by cause (points of the peak)", "the other order", "plan s"]  # fmt: skip
    lines = [f"### FPDT's setups on its testbed ({FPDT_TESTBED.name}: 4 per node, 1 TiB host memory per node)", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        plan = r["plan"]
        cells = [r["model"], str(r["gpus"]), f"{r['seq_len'] // (K * K)}M"]
        if plan is None:
            cells += [f"no fit: {r['no_fit']}"] + ["-"] * 5
        else:
            order = "layer" if plan["order"] == "layer" else plan["schedule"]
            cells += [
                f"{order}, {plan['sp']}/{plan['pp']}/{plan['dp']}/{plan['num_subsequences']}, {plan['recompute']},"
                f" {plan['offload']}, {plan['model_state']}",
                format_bytes(plan["peak_gpu_bytes"]), format_bytes(plan["peak_host_bytes"]),
                f"{plan['tokens_per_gpu_per_s']:.1f}", f"{plan['mfu']:.1%}",
            ]  # fmt: skip
        cells.append(r["fpdt_mfu"])
        cells.append(_terms(plan, r))
        cells.append(plan["other_schedules"][-1] if plan and plan["other_schedules"] else "-")
        cells.append(f"{r['planning_s']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _terms(plan: dict | None, row: dict) -> str:
    """The layer order's MFU lost by cause, largest first (its plan's, or the layer order's best when the other
    order won)."""
    layered = plan if plan is not None and plan.get("order") == "layer" else row["layer_order"]["plan"]
    if layered is None or not layered.get("mfu_terms"):
        return "-"
    step = layered["step_time_s"]
    lost = sorted(layered["mfu_terms"].items(), key=lambda item: -item[1])
    return ", ".join(f"{name} {seconds / step:.1%}" for name, seconds in lost if seconds / step >= 0.0005)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/")
    args = parser.parse_args(argv)
    tables, report = [], {"runs": []}
    for title, profile, precision in RUNS:
        rows = []
        for model, gpus, sp, pp, setups in PAPER_TABLE_4:
            for seq_len, n in setups:
                rows.append(plan_row(model, gpus, seq_len, (sp, pp, n), profile, precision))
                if (title, model, seq_len) in LOSSY_ROWS:
                    rows.append(plan_row(model, gpus, seq_len, (sp, pp, n), profile, precision, kv_grad="bf16"))
        tables.append(markdown(title, rows))
        report["runs"].append({"title": title, "profile": profile.to_dict(), "precision": precision, "rows": rows})
        print(tables[-1] + "\n", flush=True)
    fpdt = [fpdt_row(*setup) for setup in FPDT_SETUPS]
    tables.append(fpdt_markdown(fpdt))
    report["fpdt"] = {"profile": FPDT_TESTBED.to_dict(), "rows": fpdt}
    print(tables[-1] + "\n", flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(), "notes": NOTES}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner_paper_setups.json").write_text(json.dumps(meta | report, indent=2) + "\n")
    rows = [row for run in report["runs"] for row in run["rows"]]
    ratios = [row["ours_over_paper"] for row in rows if row["ours_over_paper"] is not None]
    header = [
        "# Planner on the SPPO paper's setups (Table 4)",
        "",
        f"Predictions by `lightning_sppo.planner` ({meta['date']}, torch {meta['torch']}); no GPU was used.",
        "Command: `python benchmarks/planner_paper_setups.py`. Layouts are SP/PP/DP/N.",
        "",
        f"Ours / paper's layout, tokens/GPU/s under the same model: {min(ratios):.2f} to {max(ratios):.2f} over the"
        f" {len(ratios)} rows where both fit. Planning took {min(r['planning_s'] for r in rows):.1f} to"
        f" {max(r['planning_s'] for r in rows):.1f} s per setup ({platform.processor() or platform.machine()},"
        f" {os.cpu_count()} cores, one thread).",
        "",
    ]
    notes = ["", "Notes:", ""] + [f"- {note}" for note in NOTES]
    (out / "planner_paper_setups.md").write_text("\n".join(header + ["\n\n".join(tables)] + notes) + "\n")
    print(f"wrote {out / 'planner_paper_setups'}.{{md,json}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
