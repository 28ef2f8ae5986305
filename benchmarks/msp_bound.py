"""How much multiplexed sequence partitioning (the "sppo" schedule) can gain over seq1f1b, and what stops it.

For the setup issue 15 names (GPT-65B, 768K tokens, 16 x 8 A100-80GB on the paper's testbed, on the layout the
planner chooses for it) and for the paper's GPT-13B and GPT-65B layouts (Table 4, flops partition), each row gives
sppo's predicted speed-up over seq1f1b four ways, from the most to the least idealised:

* **uniform**: the schedules alone, every F = 1 and B = 2 (a shard its share); what ``schedule_sim.py`` reports;
* **compute-proportional**: the schedules alone, F of subsequence i proportional to one layer's forward FLOPs of
  that subsequence of the partition (matmuls and causal attention over its prefix), B = 2 F;
* **free links**: the planner's full model with every GPU-to-GPU link made 10^6 GB/s, for both schedules: what
  sppo could give if moving weights, K/V and gradients between stages cost nothing (host copies unchanged);
* **testbed**: the planner's prediction on the paper's testbed (12.5 GB/s per GPU between nodes, at 90%).

The last columns are a floor on the traffic multiplexing needs, whatever the runtime does: a helper must receive
the weights of each stage it helps at least once for that stage's forward and once for its backward (keeping
them from one to the other means holding every helped stage's weights for the whole step) and return that
stage's weight gradients at least once, at 2 bytes a parameter each way (bf16, blocks only). Summed over the
stages the busiest helper helps and divided by the testbed's network bandwidth, it is set against the seconds
"free links" saves: where the floor is larger, no way of moving the weights wins unless all of it hides behind
compute, which needs the weights on the GPU ahead of use.

Predictions only (no GPU runs): every time comes from the planner's cost model, not a measurement.

Run:  python benchmarks/msp_bound.py        # writes benchmarks/results/msp_bound.{md,json} (~1 min)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.planner_paper_setups import PAPER_MSP_SPEEDUP, PAPER_TABLE_4, TESTBED  # noqa: E402
from benchmarks.schedule_sim import scaled_costs  # noqa: E402
from lightning_sppo import GPTConfig  # noqa: E402
from lightning_sppo.partition import split_sequence  # noqa: E402
from lightning_sppo.planner import PlanRequest, assess_layout, solve  # noqa: E402
from lightning_sppo.planner.flops import block_matmul_params, layer_forward_flops  # noqa: E402
from lightning_sppo.planner.solver import granularity  # noqa: E402
from lightning_sppo.schedule import build_schedule, simulate  # noqa: E402
from lightning_sppo.schedule.msp import multiplexed_groups  # noqa: E402
from lightning_sppo.schedule.multiplexed import PLACEMENT_COSTS  # noqa: E402

K = 1024
GIB = 2**30
FREE_GBPS = 1e6
"""GPU-to-GPU bandwidth of the "free links" profile: transfers take no time."""
ISSUE_SETUP = ("gpt-65b", 768 * K, 16)
"""Issue 15: "sppo-plan --schedule auto chooses sppo ... at least for GPT-65B at 768K on 16 x 8 A100-80GB"."""


def schedule_speedup(pp: int, n: int, weights: list[float] | None = None) -> dict:
    """seq1f1b / sppo makespan from the schedules alone: uniform costs, or F_i proportional to ``weights``."""
    factors = [1.0] * n if weights is None else [w * n / sum(weights) for w in weights]
    cost = scaled_costs(PLACEMENT_COSTS, factors)
    runs = {name: simulate(build_schedule(name, pp, n, 1), cost) for name in ("seq1f1b", "sppo")}
    return {
        "speedup": runs["seq1f1b"].makespan / runs["sppo"].makespan,
        "bubble": {name: run.bubble_ratio for name, run in runs.items()},
    }


def compute_weights(config: GPTConfig, lengths: list[int]) -> list[float]:
    """One layer's forward FLOPs of each subsequence of the partition."""
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    return [layer_forward_flops(config, n, o) for n, o in zip(lengths, offsets, strict=True)]


def traffic_floor(config: GPTConfig, pp: int, n: int, inter_node_gbps: float) -> dict:
    """Bytes and seconds the busiest helper must move at least (module docstring), over the network."""
    helped: dict[int, set[int]] = {rank: set() for rank in range(pp)}
    for (stage, _, _), ranks in multiplexed_groups(pp, n, 1).items():
        for rank in ranks:
            if rank != stage:
                helped[rank].add(stage)
    stage_params = block_matmul_params(config) * config.n_layer / pp
    per_stage = 3 * 2 * stage_params  # weights in for forward and for backward, gradients out: bf16
    busiest = max(helped, key=lambda rank: len(helped[rank]))
    nbytes = len(helped[busiest]) * per_stage
    return {
        "busiest_rank": busiest,
        "stages_helped": len(helped[busiest]),
        "bytes": nbytes,
        "seconds": nbytes / (inter_node_gbps * 1e9),
    }


def testbed_request(model: str, seq_len: int, nodes: int) -> PlanRequest:
    """The planner's request for a setup on the paper's testbed, bf16-mixed, every schedule open."""
    return PlanRequest(
        config=GPTConfig.from_name(model), seq_len=seq_len, nodes=nodes, profile=TESTBED, precision="bf16-mixed"
    )


def assess_both(request: PlanRequest, sp: int, pp: int, n: int, partition: str) -> dict:
    out = {}
    for name in ("seq1f1b", "sppo"):
        a = assess_layout(replace(request, schedule=(name,)), sp, pp, n, partition)
        out[name] = {
            "feasible": a.feasible,
            "step_time_s": a.step_time_s,
            "bubble_ratio": a.bubble_ratio,
            "peak_gpu_gib": a.peak_gpu_bytes / GIB,
        }
    both = all(out[name]["feasible"] for name in out)
    out["speedup"] = out["seq1f1b"]["step_time_s"] / out["sppo"]["step_time_s"] if both else None
    return out


def row(model: str, seq_len: int, nodes: int, layout: tuple[int, int, int, str], source: str) -> dict:
    sp, pp, n, partition = layout
    request = testbed_request(model, seq_len, nodes)
    config = request.config
    free = replace(TESTBED, intra_node_gbps=FREE_GBPS, inter_node_gbps=FREE_GBPS)
    lengths = split_sequence(seq_len, n, partition, granularity=granularity(request, sp), config=config)
    testbed = assess_both(request, sp, pp, n, partition)
    free_links = assess_both(replace(request, profile=free), sp, pp, n, partition)
    saved = None
    if free_links["speedup"] is not None:
        saved = free_links["seq1f1b"]["step_time_s"] - free_links["sppo"]["step_time_s"]
    return {
        "model": model, "seq_len": seq_len, "gpus": nodes * TESTBED.gpus_per_node, "source": source,
        "sp": sp, "pp": pp, "N": n, "partition": partition,
        "uniform": schedule_speedup(pp, n),
        "compute_proportional": schedule_speedup(pp, n, compute_weights(config, lengths)),
        "free_links": free_links, "testbed": testbed, "free_links_saved_s": saved,
        "traffic_floor": traffic_floor(config, pp, n, TESTBED.inter_node_gbps),
        "paper_msp_speedup": PAPER_MSP_SPEEDUP[model],
    }  # fmt: skip


ISSUE_LAYOUT = (8, 16, 48, "length")
"""The layout issue 15 measured multiplexing on (the plan of that time): SP=8, PP=16, N=48, length partition."""


def issue_plan() -> dict:
    """What ``sppo-plan --schedule auto`` chooses for the issue's setup: its layout and schedule."""
    plan = solve(testbed_request(*ISSUE_SETUP)).to_dict()
    return {key: plan[key] for key in ("sp", "pp", "num_subsequences", "partition_policy", "schedule", "step_time_s")}


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(rows: list[dict]) -> str:
    head = ["model", "S", "GPUs", "layout SP/PP/N", "uniform", "compute-prop.", "free links", "testbed",
            "seq1f1b s (testbed)", "sppo s (testbed)", "saved s (free links)", "traffic floor s (GB)", "paper"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t, floor = r["testbed"], r["traffic_floor"]
        cells = [
            r["model"], f"{r['seq_len'] // K}K", str(r["gpus"]),
            f"{r['sp']}/{r['pp']}/{r['N']} {r['partition']} ({r['source']})",
            _x(r["uniform"]["speedup"]), _x(r["compute_proportional"]["speedup"]),
            _x(r["free_links"]["speedup"]), _x(t["speedup"]),
            _s(t["seq1f1b"]["step_time_s"]), _s(t["sppo"]["step_time_s"]), _s(r["free_links_saved_s"]),
            f"{floor['seconds']:.1f} ({floor['bytes'] / 1e9:.0f})", f"{r['paper_msp_speedup']}x",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    chosen = issue_plan()
    layout = (chosen["sp"], chosen["pp"], chosen["num_subsequences"], chosen["partition_policy"])
    rows = [row(*ISSUE_SETUP, ISSUE_LAYOUT, "issue 15's")]
    if layout != ISSUE_LAYOUT:
        rows.append({**row(*ISSUE_SETUP, layout, "the plan's"), "auto_plan": chosen})
    for model, gpus, sp, pp, setups in PAPER_TABLE_4:
        if model in PAPER_MSP_SPEEDUP:
            rows += [row(model, seq_len, gpus // 8, (sp, pp, n, "flops"), "paper's") for seq_len, n in setups]
    text = "\n".join([
        "# How much multiplexed sequence partitioning can gain, and what stops it",
        "",
        "Command: `python benchmarks/msp_bound.py` (predictions of the planner's cost model; no GPU runs)",
        "",
        table(rows),
        "",
        f"`sppo-plan --schedule auto` on the first row's setup chooses SP={chosen['sp']} PP={chosen['pp']}"
        f" N={chosen['num_subsequences']} ({chosen['partition_policy']}), schedule {chosen['schedule']!r}"
        f" ({chosen['step_time_s']:.1f} s per step).",
        "",
        "Speed-ups are seq1f1b's step time over sppo's on the same layout. uniform: the schedules alone, F = 1,"
        " B = 2. compute-prop.: the schedules alone, F_i proportional to one layer's forward FLOPs of subsequence i."
        " free links: the planner with every GPU-to-GPU link at 10^6 GB/s (both schedules). testbed: the planner"
        " on the paper's A100 testbed. saved s: seq1f1b's step time less sppo's with free links, the most any way"
        " of moving weights, K/V and gradients could save. traffic floor: what the busiest helper must move"
        " over the network at least (each helped stage's block weights in twice and gradients out once, bf16),"
        " in seconds at 11.25 GB/s. '-': a schedule does not fit in 80 GiB.",
        "",
    ])  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "msp_bound.md").write_text(text)
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "torch": torch.__version__,
            "python": platform.python_version(), "profile": TESTBED.to_dict(), "free_gbps": FREE_GBPS}  # fmt: skip
    (args.out / "msp_bound.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
