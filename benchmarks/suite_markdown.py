"""The GPU suite's report as Markdown (``gpu_suite.md``), and the issue-31 targets computed from its rows.

Read top-down: the targets (what decides), the throughput tables, the longest sequence, the attention kernels, the
profile, the checks, then how each part used its time and the environment.
"""

from __future__ import annotations

from typing import Any

from suite_runs import AC, ENGINE_N1, LAYER, PLANNER, describe_settings

__all__ = ["markdown", "targets"]

RESULT = {True: "pass", False: "FAIL", None: "n/a"}
N1_GOAL, PLANNER_GOAL, LONGEST_GOAL = 0.97, 1.15, 2.0


def _fmt(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def _tokens(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


def _tables(data: dict[str, Any]) -> list[tuple[str, list[dict]]]:
    return [(data["model"], data["table"])] + [(o["model"], o["table"]) for o in data.get("other_models", [])]


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 31's targets on one GPU, each with its measured value and a verdict ("met", "missed", or why it was not
    measured): engine N=1 >= 0.97x the plain model's tokens/s; the planner's choice >= 1.15x plain + AC (and, beside it,
    the layer order's ratio); the planner's choice's longest sequence >= 2x plain + AC's."""
    sizes, out = data["sizes"], []
    for model, rows in _tables(data):
        by = {(r["run"], r["seq_len"]): r for r in rows}
        for s in sizes["target_n1_lens"]:
            out.append(_ratio_target(f"{model} {_tokens(s)}: engine N=1 / plain", by.get((ENGINE_N1, s)),
                                     "ratio_to_plain", N1_GOAL))  # fmt: skip
        for s in sizes["target_planner_lens"]:
            out.append(_ratio_target(f"{model} {_tokens(s)}: planner's choice / plain + AC", by.get((PLANNER, s)),
                                     "ratio_to_ac", PLANNER_GOAL))  # fmt: skip
            out.append(_ratio_target(f"{model} {_tokens(s)}: layer order / plain + AC", by.get((LAYER, s)),
                                     "ratio_to_ac", PLANNER_GOAL))  # fmt: skip
    longest = {r["run"]: r for r in data.get("longest", [])}
    what = f"{data['model']}: longest, planner's choice / plain + AC"
    ac, planner = longest.get(AC), longest.get(PLANNER)
    if not ac or not planner or not ac.get("longest") or not planner.get("longest"):
        out.append({"target": what, "goal": LONGEST_GOAL, "value": None, "verdict": "not measured"})
    else:
        value = planner["longest"] / ac["longest"]
        bounds = [f"{r['run']} {r['stopped']}" for r in (ac, planner) if r["stopped"] != "bracket closed"]
        verdict = "met" if value >= LONGEST_GOAL else "missed"
        if bounds:  # a search cut short: its longest is a lower bound only
            verdict += f" (bounds only: {', '.join(bounds)})"
        out.append({"target": what, "goal": LONGEST_GOAL, "value": value, "verdict": verdict})
    return out


def _ratio_target(what: str, row: dict | None, key: str, goal: float) -> dict[str, Any]:
    if row is None:
        return {"target": what, "goal": goal, "value": None, "verdict": "not measured (no row)"}
    value = row.get(key)
    if value is None:
        return {"target": what, "goal": goal, "value": None, "verdict": f"not measured ({row['status']})"}
    return {"target": what, "goal": goal, "value": value, "verdict": "met" if value >= goal else "missed"}


def markdown(data: dict[str, Any]) -> str:
    env = data["environment"]
    lines = [f"# GPU suite: {env['device']}, commit {env['git_commit']}, {env['date'][:10]}", ""]
    lines += _targets(data) + _throughput(data) + _longest(data) + _kernels(data) + _profile(data)
    lines += _checks(data) + _parts(data)
    lines += ["## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", "## Notes", ""] + [f"- {note}" for note in data["notes"]]
    return "\n".join(lines) + "\n"


def _targets(data: dict[str, Any]) -> list[str]:
    lines = ["## What decides (issue 31's targets on one GPU)", "", "| target | goal | measured | verdict |",
             "|---|---|---|---|"]  # fmt: skip
    for t in data.get("targets", []):
        lines.append(f"| {t['target']} | >= {t['goal']:g} | {_fmt(t['value'], '.2f')} | {t['verdict']} |")
    return lines + [""]


TABLE_HEAD = ["S", "run", "tokens/s", "vs plain", "vs plain + AC", "s/step", "peak alloc GiB", "peak reserved GiB",
              "host bytes/step", "MFU", "attention", "settings"]  # fmt: skip


def _throughput(data: dict[str, Any]) -> list[str]:
    lines = []
    for model, rows in _tables(data):
        lines += [f"## Throughput: {model}, bf16 autocast, one {data['environment']['device']}", ""]
        lines += ["| " + " | ".join(TABLE_HEAD) + " |", "|" + "---|" * len(TABLE_HEAD)]
        for r in rows:
            settings = describe_settings(r["settings"]) if r.get("settings") else ""
            if r["status"] != "ok":
                cells = [_tokens(r["seq_len"]), r["run"], r["status"]] + [""] * 8 + [settings]
            else:
                cells = [_tokens(r["seq_len"]), r["run"], f"{r['tokens_per_s']:.0f}", _fmt(r["ratio_to_plain"], ".2f"),
                         _fmt(r["ratio_to_ac"], ".2f"), f"{r['seconds']:.3f}", _fmt(r["peak_allocated_gib"], ".1f"),
                         _fmt(r["peak_reserved_gib"], ".1f"), f"{r['host_bytes']:,}", _fmt(r["mfu"], ".1%"),
                         r["attention"], settings]  # fmt: skip
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        lines.append("")
    return lines


def _longest(data: dict[str, Any]) -> list[str]:
    lines = ["## Longest sequence that fits (one step per probe)", "",
             "| run | longest | first failure | stopped | probes |", "|---|---|---|---|---|"]  # fmt: skip
    for r in data.get("longest", []):
        probes = []
        for d in r.get("probe_detail", []):
            how = "" if d.get("fits") else f" ({d.get('status', 'no')})"
            settings = f" [{describe_settings(d['settings'])}]" if d.get("settings") else ""
            probes.append(f"{_tokens(d['seq_len'])}{how}{settings} {d.get('seconds', 0):.0f} s")
        stopped = r["stopped"]
        if stopped == "time budget" and r.get("next_probe_estimate_s"):
            stopped += f" (the next probe needed ~{r['next_probe_estimate_s']:.0f} s)"
        if r.get("planned_longest"):
            probes.insert(0, f"planner's own longest {_tokens(r['planned_longest'])}")
        lines.append(f"| {r['run']} | {_tokens(r['longest'])} | {_tokens(r['first_failure'])} | {stopped} |"
                     f" {'; '.join(probes)} |")  # fmt: skip
    return lines + [""]


def _kernels(data: dict[str, Any]) -> list[str]:
    rows = data.get("kernels", [])
    lens = sorted({r["seq_len"] for r in rows})
    names = list(dict.fromkeys(r["backend"] for r in rows))
    head = ["backend", "kernel"] + [_tokens(s) for s in lens]
    lines = ["## Attention forward + backward, TFLOP/s (causal, bf16)", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]  # fmt: skip
    for name in names:
        by = {r["seq_len"]: r for r in rows if r["backend"] == name}
        kernel = next((r["kernel"] for r in by.values() if r.get("kernel")), "")
        cells = [f"{by[s]['tflops']:.3g}" if by.get(s, {}).get("status") == "ok" else by.get(s, {}).get("status", "")
                 for s in lens]  # fmt: skip
        lines.append("| " + " | ".join([name, kernel, *cells]) + " |")
    why = {r["backend"]: r["why"] for r in rows if r.get("why")}
    return lines + [""] + [f"- {name} unavailable: {text}" for name, text in why.items()] + ([""] if why else [])


def _profile(data: dict[str, Any]) -> list[str]:
    section = data.get("profile") or {}
    if not section:
        return []
    lines = [f"## Profile: {section['model']} at S={_tokens(section['seq_len'])}, one step each", ""]
    for r in section["runs"]:
        if r["status"] != "ok":
            lines += [f"- {r['run']}: {r['status']}", ""]
            continue
        lines += [f"### {r['run']}: {r['total_ms']:.1f} ms of {r['what']} ({r['kernels']} kinds); attention:"
                  f" {r['attention']}", "", "| kernel | ms | calls |", "|---|---|---|"]  # fmt: skip
        lines += [f"| `{k['name'][:100]}` | {k['total_ms']:.2f} | {k['calls']} |" for k in r["top"]] + [""]
    if section.get("difference"):
        lines += ["### Where engine N=1's time differs from plain's", "",
                  "| kernel | engine ms | plain ms | extra ms | engine calls | plain calls |", "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| `{d['name'][:100]}` | {d['engine_ms']:.2f} | {d['plain_ms']:.2f} | {d['extra_ms']:+.2f} |"
                  f" {d['engine_calls']} | {d['plain_calls']} |" for d in section["difference"]] + [""]  # fmt: skip
    return lines


def _checks(data: dict[str, Any]) -> list[str]:
    lines = ["## Checks", "", "| check | result | value | limit | detail |", "|---|---|---|---|---|"]
    for c in data["checks"]:
        lines.append(
            f"| {c['name']} | {RESULT[c['passed']]} | {_fmt(c['value'])} | {_fmt(c['limit'])} | {c['detail']} |"
        )
    return lines + [""]


def _parts(data: dict[str, Any]) -> list[str]:
    lines = [f"## Parts (budget {data['budget']['total_s']:g} s)", "", "| part | status | seconds | allotted s |",
             "|---|---|---|---|"]  # fmt: skip
    for p in data["parts"]:
        lines.append(f"| {p['name']} | {p['status']} | {_fmt(p['seconds'], '.1f')} | {p['allotted_s']:g} |")
    planner = data.get("planner") or {}
    if planner:
        lines += ["", f"Planner profile: {planner.get('source')}"]
    return lines + [""]
