"""The planner's predictions against every step the project has measured on a GPU: the error table of docs/planner.md.

    python benchmarks/planner_vs_gpu.py                      # built-in h100 profile; writes benchmarks/results/
    python benchmarks/planner_vs_gpu.py --gpu my-gpu.json    # a calibrated or fitted profile instead

Every row of every GPU result under ``benchmarks/results/gpu_rows/`` (and ``benchmarks/results/gpu/`` once the suite
writes there) is predicted by the planner's own functions (``planner.fit.check_suite``: the engine through
``planner.evaluate``/``step_time``, the plain model and plain + AC through ``planner.plain``), with the attention
kernel the row ran, on the profile as given: nothing is fitted to these rows. Printed per row: measured and predicted
step time, peak allocated and peak reserved bytes; rows that ran out of memory, and the longest-sequence probes that
fit, are checked as fits-or-not. Then the mean and worst errors, for the suite's engine rows and for all rows.

A negative control runs the same table on the profile with its matmul rate halved: the table must catch it (some
row's step time off by more than the 15% bound). Results: ``benchmarks/results/planner_vs_gpu.{json,md}``.

Row sources: a ``gpu_suite.json`` (``benchmarks/gpu_suite.py``) is read as the planner reads it (``--fit-suite``); a
``*.jsonl`` of ``engine_vs_ac.py`` rows (no ``planner`` entries, no environment) is read with its sibling
``gpu_suite.json``'s environment and model, the engine's partition rebuilt from the run's name (N, the flops policy
``engine_vs_ac.py`` ran); the suite's ``longest`` probes become fits-or-not rows.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.partition import split_sequence
from lightning_sppo.planner.fit import RunFit, Suite, check_suite, format_runs, load_suite
from lightning_sppo.planner.profile import resolve_profile

ROOT = Path(__file__).resolve().parent
SOURCES = (ROOT / "results" / "gpu_rows", ROOT / "results" / "gpu")
OUT = ROOT / "results"
TIME_BOUND, MEMORY_BOUND = 0.15, 0.10
"""Issue 33's bounds: step time within 15%, peak memory within 10%, on every row."""
_ENGINE = re.compile(r"engine N=(\d+) offload=(\w+)(?: recompute=(\w+))?(?: kv_device=([\d.]+)S)?$")


def suites(sources: tuple[Path, ...] = SOURCES) -> list[Suite]:
    """Every GPU result under ``sources``: each directory's ``gpu_suite.json`` (with its longest probes) and its
    ``*.jsonl`` rows."""
    out = []
    for folder in sorted({p.parent for source in sources if source.exists() for p in source.rglob("gpu_suite.json")}):
        data = json.loads((folder / "gpu_suite.json").read_text())
        where = folder.relative_to(ROOT.parent) if folder.is_relative_to(ROOT.parent) else folder
        out.append(load_suite(data | {"table": data["table"] + _longest_rows(data)}, f"{where}/gpu_suite.json"))
        for extra in sorted(folder.glob("*.jsonl")):
            rows = [json.loads(line) for line in extra.read_text().splitlines() if line.strip()]
            out.append(load_suite(_with_environment(rows, data), f"{where}/{extra.name}"))
    return out


def _with_environment(rows: list[dict], suite: dict) -> dict:
    """``engine_vs_ac.py``'s rows as a suite: its sibling suite's model and environment, each engine row's partition
    rebuilt from its name (the script ran ``engine_run(N, ...)``, flops partition, granularity 1)."""
    config = GPTConfig.from_name(suite["model"], block_size=max(r["seq_len"] for r in rows))
    table = [_planner_entry(row, config) for row in rows]
    return {"model": suite["model"], "model_block_size": config.block_size, "environment": suite["environment"],
            "table": table}  # fmt: skip


def _planner_entry(row: dict, config: GPTConfig) -> dict:
    match = _ENGINE.match(row["run"])
    if match is None:
        return row
    n, offload, recompute, share = match.groups()
    seq_len = row["seq_len"]
    partition = split_sequence(seq_len, int(n), "flops", granularity=1, config=config)
    kv = None if share is None else int(float(share) * seq_len)
    entry = {"partition": partition, "offload": offload, "recompute": recompute or "none", "kv_device_tokens": kv}
    return row | {"planner": entry}


def _longest_rows(data: dict) -> list[dict]:
    """The suite's longest-sequence probes as untimed rows: "fits" or "OOM" (``benchmarks/gpu_suite.py``'s
    ``LONGEST_RUNS``: the engine's probes cut S / ``tokens_per_subsequence`` subsequences, flops partition)."""
    config = GPTConfig.from_name(data["model"], block_size=data.get("model_block_size") or 2**20)
    per_subsequence = data.get("sizes", {}).get("tokens_per_subsequence", 8192)
    rows = []
    for result in data.get("longest", []):
        name = result["run"]
        for seq_len, fits in result.get("probes", []):
            row = {"run": f"longest: {name}", "seq_len": seq_len, "status": "fits" if fits else "OOM"}
            if name.startswith("engine"):
                n = max(1, seq_len // per_subsequence)
                recompute = "full" if "full recompute" in name else "none"
                kv = 0 if "K/V on host" in name else None
                row["planner"] = {"partition": split_sequence(seq_len, n, "flops", granularity=1, config=config),
                                  "offload": "adaptive", "recompute": recompute, "kv_device_tokens": kv}  # fmt: skip
            elif name not in ("plain", "plain + AC"):
                continue
            else:
                row["run"] = name
            rows.append(row)
    return rows


def table(profile_spec: str, sources: tuple[Path, ...] = SOURCES) -> tuple[list[RunFit], object]:
    profile = resolve_profile(profile_spec)
    fits = [fit for suite in suites(sources) for fit in check_suite(suite, profile)]
    return fits, profile


def errors(fits: list[RunFit]) -> dict:
    """Mean and worst |error| of time, allocated and reserved bytes, and how many untimed rows agree."""
    out = {}
    for what, key in (("time", "time_error"), ("allocated", "allocated_error"), ("reserved", "memory_error")):
        values = [abs(getattr(f, key)) for f in fits if getattr(f, key) is not None]
        out[what] = {"mean": sum(values) / len(values), "worst": max(values), "rows": len(values)} if values else None
    verdicts = [f.fit_agrees for f in fits if f.fit_agrees is not None]
    out["fits_or_not"] = {"agree": sum(verdicts), "rows": len(verdicts)}
    return out


def _engine_suite_rows(fits: list[RunFit]) -> list[RunFit]:
    """The shared suite's 12 engine rows at 16K (issue 33's acceptance set)."""
    return [f for f in fits if f.run.plain is None and f.run.timed and "gpu_suite" in f.run.source]


def negative_control(fits: list[RunFit], control: list[RunFit]) -> tuple[list[str], list[str]]:
    """(the timed rows within the time bound, those of them the control profile puts beyond it)."""
    meeting = [f.run.label for f in fits if f.run.timed and abs(f.time_error) <= TIME_BOUND]
    by_label = {f.run.label: f for f in control if f.run.timed}
    return meeting, [label for label in meeting if abs(by_label[label].time_error) > TIME_BOUND]


def _row(fit: RunFit) -> dict:
    run, pred = fit.run, fit.predicted
    return {
        "run": run.name, "seq_len": run.seq_len, "status": run.status, "kernel": run.attention, "source": run.source,
        "measured_s": run.step_s, "predicted_s": pred.step_s, "time_error": fit.time_error,
        "measured_allocated": run.allocated_bytes, "predicted_allocated": pred.allocated_bytes,
        "allocated_error": fit.allocated_error, "measured_reserved": run.peak_bytes,
        "predicted_reserved": pred.reserved_bytes, "reserved_error": fit.memory_error, "fit_agrees": fit.fit_agrees,
    }  # fmt: skip


def markdown(fits: list[RunFit], profile, control: list[RunFit]) -> str:
    engine = _engine_suite_rows(fits)
    lines = [
        f"# Planner vs GPU: every measured row, profile `{profile.name}`",
        "",
        "`python benchmarks/planner_vs_gpu.py` (no fit on these rows). Times in seconds per step, memory in GiB;"
        " errors are predicted / measured - 1. Untimed rows: OOM (ran out) or fits (a longest-sequence probe).",
        "",
        "| run | S | kernel | step s | pred s | err | alloc | pred | err | reserved | pred | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fit in fits:
        lines.append(_md_row(fit))
    lines += ["", "| rows | step time mean / worst | allocated mean / worst | reserved mean / worst | fits or not |",
              "|---|---|---|---|---|"]  # fmt: skip
    for label, rows in (("the suite's 12 engine rows (16K)", engine), ("every row", fits)):
        lines.append(_md_summary(label, rows))
    lines += [
        "",
        f"Negative control: the same profile with its matmul rate halved (mfu {profile.mfu / 2:.3f}):",
        "",
        "| rows | step time mean / worst | allocated mean / worst | reserved mean / worst | fits or not |",
        "|---|---|---|---|---|",
        _md_summary("the suite's 12 engine rows (16K)", _engine_suite_rows(control)),
        _md_summary("every row", control),
        "",
        "Caught: {} of the {} timed rows within {:.0%} under the profile are beyond it under the control.".format(
            *(lambda m, c: (len(c), len(m)))(*negative_control(fits, control)), TIME_BOUND
        ),
    ]
    return "\n".join(lines) + "\n"


def _md_row(fit: RunFit) -> str:
    run, pred = fit.run, fit.predicted
    gib = 2**30

    def num(value, spec=".3f"):
        return "" if value is None else format(value, spec)

    def err(value):
        return "" if value is None else f"{value:+.1%}"

    measured_s = run.status if not run.timed else num(run.step_s)
    return (
        f"| {run.name} | {run.seq_len} | {run.attention} | {measured_s} | {pred.step_s:.3f} | {err(fit.time_error)} |"
        f" {num(run.allocated_bytes and run.allocated_bytes / gib, '.1f')} | {pred.allocated_bytes / gib:.1f} |"
        f" {err(fit.allocated_error)} | {num(run.peak_bytes and run.peak_bytes / gib, '.1f')} |"
        f" {pred.reserved_bytes / gib:.1f} | {err(fit.memory_error)} |"
        + ("" if fit.fit_agrees is None else f" {'agrees' if fit.fit_agrees else 'DISAGREES'} |")
    )


def _md_summary(label: str, fits: list[RunFit]) -> str:
    e = errors(fits)

    def pair(what):
        return "-" if e[what] is None else f"{e[what]['mean']:.1%} / {e[what]['worst']:.1%} ({e[what]['rows']})"

    verdict = e["fits_or_not"]
    return f"| {label} | {pair('time')} | {pair('allocated')} | {pair('reserved')} | {verdict['agree']} of {verdict['rows']} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100", help="built-in profile or profile JSON (default h100)")
    parser.add_argument("--out", type=Path, default=OUT, help="where to write planner_vs_gpu.{json,md}")
    args = parser.parse_args(argv)
    fits, profile = table(args.gpu)
    halved = replace(profile, mfu=profile.mfu / 2)
    control = [fit for suite in suites() for fit in check_suite(suite, halved)]
    print("\n".join(format_runs(fits)))
    engine, control_engine = errors(_engine_suite_rows(fits)), errors(_engine_suite_rows(control))
    meeting, caught = negative_control(fits, control)
    print(f"\nthe suite's 12 engine rows: {engine}\nnegative control (mfu halved): {control_engine}")
    print(f"negative control: {len(caught)} of the {len(meeting)} timed rows within {TIME_BOUND:.0%} miss it: {caught}")
    report = {
        "profile": profile.to_dict(), "rows": [_row(f) for f in fits], "engine_rows": engine, "all_rows": errors(fits),
        "negative_control": {"mfu": halved.mfu, "engine_rows": control_engine, "all_rows": errors(control),
                             "rows_within_bound": meeting, "caught": caught},
        "bounds": {"time": TIME_BOUND, "memory": MEMORY_BOUND},
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planner_vs_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "planner_vs_gpu.md").write_text(markdown(fits, profile, control))
    print(f"wrote {args.out / 'planner_vs_gpu.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
