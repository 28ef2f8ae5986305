"""Predicted pipeline bubbles, makespan and live activations of the schedules, from the simulator alone.

For each schedule, pp, N and M it simulates the compute-only schedule (no GPU, no processes) with
uniform costs F=1, B=--backward-cost per (micro-batch, subsequence) on every stage, checks the bubble
ratio of gpipe and seq1f1b against (p-1)/(M*N) and that "sppo" (multiplexed sequence partitioning: a
shared unit's shard costs its share) finishes strictly before seq1f1b when pp > 1 (exit status 1 if
not), and simulates it again with each subsequence's F and B scaled by its FLOPs
2 n_i P + 2 L n_i (n_0 + ... + n_i) d under a length-balanced and a flops-balanced partition (--model,
--seq-len), normalised so the busy time per stage equals the uniform case.
It also draws the per-rank timelines of every schedule for pp=4, N=8 at M=1 and M=2 (needs matplotlib).
Communication is free in that table: the shared units' transfers are not charged.

Then, for the SPPO paper's GPT-13B and GPT-65B setups (Table 4: SP, PP, N per sequence length, on its A100 testbed
as ``planner_paper_setups.TESTBED`` describes it), the speed-up of sppo over seq1f1b on the paper's own layout, twice:
from the schedule alone (uniform costs, no communication, as above) and as the planner predicts it (per-stage
costs, and the communication counted: weights streamed per layer, K/V streams, the groups' all-to-alls), next to the
paper's measured 1.44x and 3.48x (section 7.2). ``--no-paper`` skips it (it runs the planner: a minute or two).

Run:  python benchmarks/schedule_sim.py
      python benchmarks/schedule_sim.py --backward-cost 3 --pp 2 4 -n 8 16 -m 1 2 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.partition import flops, length
from lightning_sppo.schedule import Action, Op, build_schedule, simulate

SCHEDULE_NAMES = ["gpipe", "seq1f1b", "sppo"]
PLAIN = ("gpipe", "seq1f1b")  # no shared units: the bubble is (p-1)/(MN) exactly
COLUMNS = ["schedule", "pp", "N", "M", "bubble", "(p-1)/(MN)", "makespan", "peak live (max)", "peak live (rank 0)",
           "bubble len-part", "makespan len-part", "bubble flops-part", "makespan flops-part"]  # fmt: skip
NOTES = [
    "Times are in units of one uniform forward (F=1); 'bubble' is (makespan - mean busy) / mean busy.",
    "Peak live activations count (micro-batch, subsequence) units whose F ran and B has not on a rank;"
    " under a length-balanced partition every unit holds the same bytes, under a flops one early units hold more.",
    "len-part / flops-part: F and B of subsequence i cost N * w_i / sum(w) times the uniform cost, with"
    " w_i = 2 n_i P + 2 L n_i (n_0 + ... + n_i) d for the lengths n_i of that partition; the busy time per stage"
    " is the uniform one, so makespans compare directly.",
]

PAPER_NOTES = [
    "schedule only: makespan of seq1f1b / sppo at uniform costs (F = 1, B = 2 per unit, a shard its share), no"
    " communication: what multiplexing the bubble-adjacent subsequences can give at most.",
    "predicted: the planner's step time of seq1f1b / sppo on the paper's SP/PP/N (flops partition), each with its"
    " fastest FSDP sync mode and first offload policy that fits, on the paper's A100 testbed (12.5 GB/s per GPU"
    " between nodes, 90% usable); sppo's shared units pay their traffic (``planner.multiplexed``). The paper's"
    " GPT-65B layout (SP=16) crosses nodes; the planner only assesses it.",
    "Why the prediction is far below the paper's: every group of a shared unit spans pipeline stages on different"
    " nodes, every rank takes part in about pp^2 / 2 shared units per step, and each moves a piece's weights per layer"
    " in and its gradient out, plus, for late subsequences, the prefix K/V of its heads; the transfers exceed the"
    " compute a share takes off its owner. The paper does not say how its MSP gets the weights to the helpers.",
]


def flops_weights(lengths: list[int], config: GPTConfig) -> list[float]:
    """Per subsequence, its FLOPs relative to the mean: N * w_i / sum(w)."""
    num_params = config.num_parameters() - config.vocab_size * config.n_embd  # as partition.flops counts P
    ld, prefix, weights = config.n_layer * config.n_embd, 0, []
    for n_i in lengths:
        prefix += n_i
        weights.append(2.0 * n_i * num_params + 2.0 * ld * n_i * prefix)
    return [len(weights) * w / sum(weights) for w in weights]


def scaled_costs(base: dict[str, float], factors: list[float]) -> Callable[[int, Action], float]:
    """(rank, action) -> base cost of the op times the factor of the action's subsequence (a shard: its share)."""

    return lambda rank, action: base[str(action.op)] * factors[action.subsequence] * action.share


def run_case(name: str, pp: int, n: int, m: int, base: dict[str, float], factors: dict[str, list[float]]) -> dict:
    schedule = build_schedule(name, pp, n, m)
    uniform = simulate(schedule, base)
    row = {"schedule": name, "pp": pp, "N": n, "M": m, "bubble": uniform.bubble_ratio,
           "formula": (pp - 1) / (m * n), "makespan": uniform.makespan,
           "peak_live": uniform.peak_live_activations}  # fmt: skip
    for part, f in factors.items():
        result = simulate(schedule, scaled_costs(base, f))
        row[f"bubble_{part}"], row[f"makespan_{part}"] = result.bubble_ratio, result.makespan
    return row


def run_all(args: argparse.Namespace) -> tuple[list[dict], dict[int, dict[str, list[int]]]]:
    config = GPTConfig.from_name(args.model)
    base = {"F": 1.0, "B": args.backward_cost}
    rows, partitions = [], {}
    for n in args.num_subsequences:
        partitions[n] = {"len": length(args.seq_len, n), "flops": flops(args.seq_len, n, config=config)}
        factors = {part: flops_weights(lengths, config) for part, lengths in partitions[n].items()}
        rows += [run_case(name, pp, n, m, base, factors) for name in SCHEDULE_NAMES for pp in args.pp
                 for m in args.num_microbatches]  # fmt: skip
    rows.sort(key=lambda r: (r["schedule"], r["pp"], r["N"], r["M"]))
    return rows, partitions


def check_formula(rows: list[dict]) -> list[str]:
    """Plain schedules: bubble == (p-1)/(MN). "sppo": makespan strictly below seq1f1b's when pp > 1."""
    problems = [f"{r['schedule']} pp={r['pp']} N={r['N']} M={r['M']}: bubble {r['bubble']:.6f} vs {r['formula']:.6f}"
                for r in rows if r["schedule"] in PLAIN
                and not math.isclose(r["bubble"], r["formula"], rel_tol=1e-9, abs_tol=1e-12)]  # fmt: skip
    seq1f1b = {(r["pp"], r["N"], r["M"]): r["makespan"] for r in rows if r["schedule"] == "seq1f1b"}
    problems += [f"sppo pp={r['pp']} N={r['N']} M={r['M']}: makespan {r['makespan']:g} not below seq1f1b's"
                 f" {seq1f1b[(r['pp'], r['N'], r['M'])]:g}" for r in rows if r["schedule"] == "sppo" and r["pp"] > 1
                 and not r["makespan"] < seq1f1b[(r["pp"], r["N"], r["M"])]]  # fmt: skip
    return problems


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [r["schedule"], r["pp"], r["N"], r["M"], f"{r['bubble']:.4f}", f"{r['formula']:.4f}",
                 f"{r['makespan']:.4g}", f"{max(r['peak_live']):.3g}", f"{r['peak_live'][0]:.3g}", f"{r['bubble_len']:.4f}",
                 f"{r['makespan_len']:.1f}", f"{r['bubble_flops']:.4f}", f"{r['makespan_flops']:.1f}"]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def plot_timelines(args: argparse.Namespace, path: Path, pp: int = 4, n: int = 8, m: int = 1) -> bool:
    """Per-rank timelines of each schedule, one panel above the other; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the timeline PNG (pip install matplotlib to draw it)")
        return False
    fig, axes = plt.subplots(len(SCHEDULE_NAMES), 1, figsize=(16, 2.2 * len(SCHEDULE_NAMES) + 0.8), sharex=True)
    longest = 0.0
    for ax, name in zip(axes, SCHEDULE_NAMES, strict=True):
        schedule = build_schedule(name, pp, n, m)
        result = simulate(schedule, {"F": 1.0, "B": args.backward_cost})
        for rank, actions in enumerate(schedule):
            for action, t0, t1 in zip(actions, result.start[rank], result.end[rank], strict=True):
                _draw_action(ax, rank, action, t0, t1)
        ax.set(
            yticks=range(pp),
            yticklabels=[f"rank {k}" for k in range(pp)],
            ylim=(pp - 0.5, -0.5),
        )
        longest = max(longest, result.makespan)
        peak = [round(x, 2) for x in result.peak_live_activations]
        ax.set_title(f"{name}: pp={pp}, N={n}, M={m}, F=1, B={args.backward_cost:g}; makespan {result.makespan:.4g},"
                     f" bubble {result.bubble_ratio:.4f}, peak live {peak}", fontsize=10)  # fmt: skip
    axes[-1].set_xlim(0, longest)  # shared: one time axis for every schedule
    axes[-1].set_xlabel("time (units of one forward); labels are microbatch.subsequence, /k: a shard of stage k's unit")
    handles = [plt.Rectangle((0, 0), 1, 1, color=_COLOURS[(op, mb)]) for op in (Op.F, Op.B) for mb in range(2)]
    fig.legend(handles, ["F mb 0", "F mb 1", "B mb 0", "B mb 1"], loc="upper right", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


_COLOURS = {(Op.F, 0): "#4c72b0", (Op.F, 1): "#8fb0e0", (Op.B, 0): "#dd8452", (Op.B, 1): "#f2be9a"}


def _draw_action(ax: Any, rank: int, action: Action, t0: float, t1: float) -> None:
    colour = _COLOURS[(action.op, action.microbatch % 2)]
    hatch = "//" if action.multiplexed else None
    ax.barh(rank, t1 - t0, left=t0, height=0.8, color=colour, edgecolor="black", linewidth=0.5, hatch=hatch)
    label = f"{action.microbatch}.{action.subsequence}" + (f"/{action.stage}" if action.multiplexed else "")
    ax.text((t0 + t1) / 2, rank, label, ha="center", va="center", fontsize=6 if action.multiplexed else 7)


def write_outputs(
    args: argparse.Namespace, rows: list[dict], partitions: dict, table: str, paper: list[dict] | None = None
) -> Path:
    meta = {"backward_cost": args.backward_cost, "forward_cost": 1.0, "pp": args.pp,
            "num_subsequences": args.num_subsequences, "num_microbatches": args.num_microbatches,
            "model": args.model, "seq_len": args.seq_len, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / "schedule_sim"
    report = {**meta, "notes": NOTES, "partitions": partitions, "results": rows, "paper_msp": paper}
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    header = ["# Schedule simulation: bubbles, makespan, live activations", ""]
    header += ["Command: `python benchmarks/schedule_sim.py`", ""]
    header += [f"- {key}: {value}" for key, value in meta.items()]
    notes = ["", "Notes:", ""] + [f"- {note}" for note in NOTES]
    sections = ["", table]
    if paper:
        sections += ["", "## sppo over seq1f1b on the paper's GPT-13B and GPT-65B layouts", "", paper_table(paper), "",
                     *PAPER_NOTES]  # fmt: skip
    stem.with_suffix(".md").write_text("\n".join(header + sections + notes) + "\n")
    return stem


PAPER_MSP = {"gpt-13b": 1.44, "gpt-65b": 3.48}
"""SPPO paper, section 7.2: MSP's speed-up over SPPO without it."""


def paper_rows() -> list[dict]:
    """For each GPT-13B and GPT-65B setup of the paper's Table 4: sppo's speed-up over seq1f1b on the paper's layout,
    from the schedule alone and as the planner predicts it (communication counted)."""
    from dataclasses import replace

    from benchmarks.planner_paper_setups import PAPER_TABLE_4, TESTBED
    from lightning_sppo.planner import PlanRequest, assess_layout

    rows = []
    for model, gpus, sp, pp, setups in PAPER_TABLE_4:
        if model not in PAPER_MSP:
            continue
        for seq_len, n in setups:
            uniform = {name: simulate(build_schedule(name, pp, n, 1), {"F": 1.0, "B": 2.0}).makespan
                       for name in ("seq1f1b", "sppo")}  # fmt: skip
            request = PlanRequest(config=GPTConfig.from_name(model), seq_len=seq_len, nodes=gpus // 8, profile=TESTBED)
            assessed = {name: assess_layout(replace(request, schedule=(name,)), sp, pp, n, "flops")
                        for name in ("seq1f1b", "sppo")}  # fmt: skip
            both = all(a.feasible for a in assessed.values())
            rows.append({
                "model": model, "gpus": gpus, "seq_len": seq_len, "sp": sp, "pp": pp, "N": n,
                "schedule_only": uniform["seq1f1b"] / uniform["sppo"],
                "predicted": assessed["seq1f1b"].step_time_s / assessed["sppo"].step_time_s if both else None,
                "bubbles": [assessed[name].bubble_ratio for name in ("seq1f1b", "sppo")],
                "feasible": {name: a.feasible for name, a in assessed.items()},
                "peak_gpu_gib": {name: a.peak_gpu_bytes / 2**30 for name, a in assessed.items()},
                "paper": PAPER_MSP[model],
            })  # fmt: skip
    return rows


def paper_table(rows: list[dict]) -> str:
    head = ["model", "GPUs", "S", "paper SP/PP/N", "schedule only (no comm.)", "predicted (comm. counted)",
            "bubble seq1f1b -> sppo", "peak GPU seq1f1b / sppo", "paper's MSP speed-up"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        predicted = (
            f"{r['predicted']:.2f}x"
            if r["predicted"] is not None
            else "no fit: " + ", ".join(name for name, ok in r["feasible"].items() if not ok)
        )
        bubbles = " -> ".join(f"{b:.2f}" if b is not None else "-" for b in r["bubbles"])
        peaks = " / ".join(f"{r['peak_gpu_gib'][name]:.1f} GiB" for name in ("seq1f1b", "sppo"))
        cells = [r["model"], r["gpus"], f"{r['seq_len'] // 1024}K", f"{r['sp']}/{r['pp']}/{r['N']}",
                 f"{r['schedule_only']:.2f}x", predicted, bubbles, peaks, f"{r['paper']:.2f}x"]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backward-cost", type=float, default=2.0, help="cost of one B, with F=1")
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("-n", "--num-subsequences", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("-m", "--num-microbatches", type=int, nargs="+", default=[1, 2])
    p.add_argument("--model", default="gpt-7b", choices=GPTConfig.available(), help="sizes for the FLOPs weights")
    p.add_argument("--seq-len", type=int, default=512 * 1024, help="sequence length for the FLOPs weights")
    p.add_argument("--no-plot", action="store_true", help="skip the timeline PNG")
    p.add_argument("--no-paper", action="store_true", help="skip the paper setups' predicted MSP speed-ups")
    p.add_argument("--out", default="benchmarks/results/")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, partitions = run_all(args)
    table = markdown_table(rows)
    print(table)
    paper = None if args.no_paper else paper_rows()
    if paper:
        print("\n" + paper_table(paper))
    print(f"\nwrote {write_outputs(args, rows, partitions, table, paper)}.{{json,md}}")
    for m in (1, 2):
        png = Path(args.out) / f"schedule_timeline_pp4_n8_m{m}.png"
        if not args.no_plot and plot_timelines(args, png, m=m):
            print(f"wrote {png}")
    mismatches = check_formula(rows)
    for line in mismatches:
        print(f"CHECK FAILED: {line}", file=sys.stderr)
    if not mismatches:
        print(f"checks passed: gpipe/seq1f1b bubbles equal (p-1)/(MN), sppo below seq1f1b, over {len(rows)} rows")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
