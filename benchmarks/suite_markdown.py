"""The GPU suite's report as Markdown (``gpu_suite.md``), and the issue-31 targets computed from its rows.

Read top-down: the targets (what decides), the throughput tables, the longest sequence, the attention kernels, the
profile, the checks, then how each part used its time and the environment.
"""

from __future__ import annotations

from typing import Any

from suite_runs import AC, ENGINE_N1, LAYER, PLANNER, describe_settings

__all__ = ["decisive_markdown", "decisive_targets", "markdown", "targets"]

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
    issue = "issue 40" if data.get("preset") == "decisive" else "issue 31"
    lines = [f"## What decides ({issue}'s targets on one GPU)", "", "| target | goal | measured | verdict |",
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


# -- the decisive preset ----------------------------------------------------------------------------------------

TIME_GOAL, PEAK_GOAL = 0.15, 0.10
"""Every measured row within 15% (time) and 10% (peak allocated) of the planner's prediction (issue 40)."""


def decisive_targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 40's targets, each measured or said why not: engine N=1 >= 0.97x plain at the overhead lengths; the
    planner's choice >= 1.15x AC at the long lengths (the layer order beside it); the layer order's extrapolated
    longest >= 2x AC's; every timed row within 15% (time) and 10% (peak) of the planner."""
    sizes, rows, out = data["sizes"], data.get("table", []), []
    by = {(r["run"], r["seq_len"]): r for r in rows}
    for s in sizes["overhead_lens"]:
        out.append(
            _ratio_target(f"{_tokens(s)}: engine N=1 / plain", by.get((ENGINE_N1, s)), "ratio_to_plain", N1_GOAL)
        )
    for s in sizes["long_lens"]:
        for run in (PLANNER, LAYER):
            out.append(
                _ratio_target(f"{_tokens(s)}: {run} / plain + AC", by.get((run, s)), "ratio_to_ac", PLANNER_GOAL)
            )
    runs = {r["run"]: r for r in (data.get("longest") or {}).get("runs", [])}
    layer, ac = (runs.get(name, {}).get("extrapolated_longest") for name in (LAYER, AC))
    what = "longest (extrapolated from slices): layer order / plain + AC"
    if layer and ac:
        out.append({"target": what, "goal": LONGEST_GOAL, "value": layer / ac,
                    "verdict": "met" if layer / ac >= LONGEST_GOAL else "missed"})  # fmt: skip
    elif layer and ac == 0:
        out.append({"target": what, "goal": LONGEST_GOAL, "value": None, "verdict": "met (plain + AC fits no 1K)"})
    else:
        out.append({"target": what, "goal": LONGEST_GOAL, "value": None, "verdict": "not measured"})
    timed = [r for r in rows if r["status"] == "ok" and "prediction_as_ran" in r]
    within = [r for r in timed if abs(r["prediction_as_ran"]["time_error"]) <= TIME_GOAL
              and abs(r["prediction_as_ran"].get("peak_error", 0.0)) <= PEAK_GOAL]  # fmt: skip
    share = len(within) / len(timed) if timed else None
    out.append({"target": "rows within 15% (time) and 10% (peak) of the planner", "goal": 1.0, "value": share,
                "verdict": ("not measured" if not timed else "met" if share == 1.0 else
                            f"missed ({len(timed) - len(within)} of {len(timed)} rows outside)")})  # fmt: skip
    return out


def decisive_markdown(data: dict[str, Any]) -> str:
    env = data["environment"]
    size = " (tiny sizes: checks the code, not a GPU result)" if data["tiny"] else ""
    lines = [f"# GPU suite, decisive preset{size}: {env['device']}, commit {env['git_commit']}, {env['date'][:10]}", ""]
    lines += _prediction(data) + _targets(data) + _decisive_rows(data) + _decisive_longest(data) + _fit(data)
    lines += _decisive_kernels(data) + _decisive_checks(data) + _calibration(data)
    lines += ["## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", "## Notes", ""] + [f"- {note}" for note in data["notes"]]
    return "\n".join(lines) + "\n"


def _prediction(data: dict[str, Any]) -> list[str]:
    measured = {p["name"]: p for p in data["parts"]}
    prediction = data["prediction"]
    lines = [f"## Parts: predicted ({prediction['profile']}) and measured", "",
             "| part | what | predicted s | measured s | status |", "|---|---|---|---|---|"]  # fmt: skip
    for p in prediction["parts"]:
        done = measured.get(p["part"], {})
        lines.append(f"| {p['part']} | {p['title']} | {p['predicted_s']:.0f} | {_fmt(done.get('seconds'), '.0f')} |"
                     f" {done.get('status', '')} |")  # fmt: skip
    lines += ["", f"Predicted total {prediction['total_s']:.0f} s of {prediction['limit_s']:.0f} s;"
              f" {data.get('elapsed_s', 0):.0f} s since the process started."]  # fmt: skip
    gpu = data.get("gpu_prediction") or {}
    if gpu and gpu is not prediction and gpu.get("total_s") != prediction["total_s"]:
        each = ", ".join(f"{p['part']} {p['predicted_s']:.0f}" for p in gpu["parts"])
        lines += ["", f"The real preset on one H100 ({gpu['profile']}): predicted {gpu['total_s']:.0f} s of"
                  f" {gpu['limit_s']:.0f} s: {each}"]  # fmt: skip
    return lines + [""]


ROW_HEAD = ["part", "S", "run", "status", "s/step", "planner s/step", "time err", "peak alloc GiB", "planner GiB",
            "peak err", "tokens/s", "vs plain", "vs AC", "host allocated in timed steps", "attention ran", "asked",
            "settings"]  # fmt: skip


def _decisive_rows(data: dict[str, Any]) -> list[str]:
    lines = ["## Step time and memory against the planner (bf16 autocast, one sequence per step)", "",
             "| " + " | ".join(ROW_HEAD) + " |", "|" + "---|" * len(ROW_HEAD)]  # fmt: skip
    for r in data.get("table", []):
        pred, ran = r.get("prediction") or {}, r.get("prediction_as_ran") or {}
        settings = describe_settings(r["settings"]) if r.get("settings") and "num_subsequences" in r["settings"] else ""
        status = f"does not fit ({r['status']}): {r['does_not_fit']}" if r.get("does_not_fit") else r["status"]
        gib = (r.get("peak_allocated_bytes") or 0) / 2**30 or None
        cells = [r["part"], _tokens(r["seq_len"]), r["run"], status, _fmt(r.get("seconds"), ".3f"),
                 _fmt(ran.get("step_s", pred.get("step_s")), ".3f"), _fmt(ran.get("time_error"), "+.0%"),
                 _fmt(gib, ".1f"), _fmt((ran or pred).get("peak_allocated_bytes", 0) / 2**30, ".1f"),
                 _fmt(ran.get("peak_error"), "+.0%"), _fmt(r.get("tokens_per_s"), ".0f"),
                 _fmt(r.get("ratio_to_plain"), ".2f"), _fmt(r.get("ratio_to_ac"), ".2f"), _pinned(r),
                 r.get("attention", ""), r.get("attention_asked", ""), settings]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines + [""]


def _pinned(row: dict[str, Any]) -> str:
    """Host memory the timed steps allocated (pinned on CUDA), and the host seconds it took: a one-time cost."""
    spent = row.get("host_allocations")
    if not spent:
        return ""
    return f"{spent['bytes'] / 2**30:.1f} GiB in {spent['seconds']:.1f} s"


def _decisive_longest(data: dict[str, Any]) -> list[str]:
    section = data.get("longest") or {}
    if not section:
        return []
    lines = ["## Longest sequence, from slices of the model", "", f"Method: {section['method']}.",
             f"Bytes: {section['bytes']}.", "",
             "| run | extrapolated longest | bound by | planner's longest | fit check error"
             " | probes (layers, S: GiB) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in section.get("runs", []):
        probes = "; ".join(f"{p['layers']}, {_tokens(p['seq_len'])}: "
                           + (_fmt((p.get("bytes") or 0) / 2**30, ".2f") if p.get("bytes") else p["status"])
                           for p in r["probes"])  # fmt: skip
        check = (r.get("check") or {}).get("error")
        bound = r.get("bound_by") or r.get("why", "")
        lines.append(f"| {r['run']} | {_tokens(r.get('extrapolated_longest'))} | {bound}"
                     f" | {_tokens(r.get('planner_longest'))} | {_fmt(check, '+.1%')} | {probes} |")  # fmt: skip
    return lines + [""]


def _fit(data: dict[str, Any]) -> list[str]:
    fit = data.get("fit") or {}
    if not fit:
        return []
    pred, failed = fit.get("prediction") or {}, fit.get("does_not_fit")
    lines = [f"## `sppo fit`: {fit['model']} at {_tokens(fit['seq_len'])}, {fit['config']}", "",
             f"- status: {fit.get('status', 'running')}" + (f" ({failed})" if failed else ""),
             f"- step: {_fmt(fit.get('step_s'), '.3f')} s measured (perf/step_s of the last of {fit['steps']} steps),"
             f" {_fmt(pred.get('step_s'), '.3f')} s predicted by sppo-plan ({_fmt(fit.get('time_error'), '+.0%')})",
             f"- logged: {fit.get('logged', {})}",
             f"- overrides of the shipped config: {fit.get('overrides', {})}"]  # fmt: skip
    if fit.get("log_tail"):
        lines.append(f"- its last lines: {' | '.join(fit['log_tail'])}")
    return lines + [""]


def _decisive_kernels(data: dict[str, Any]) -> list[str]:
    lines = ["## Attention kernels at the decisive shapes (bf16, one call forward + backward)", "",
             "| backend | S | causal | status | TFLOP/s | planner TFLOP/s | fwd ms | bwd ms | planner fwd/bwd ms |"
             " kernel ran |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in data.get("kernels", []):
        p = r.get("prediction") or {}
        lines.append(f"| {r['backend']} | {_tokens(r['seq_len'])} | {r['causal']} | {r['status']} |"
                     f" {_fmt(r.get('tflops'))} | {_fmt(p.get('tflops'))} | {_fmt(r.get('forward_ms'))} |"
                     f" {_fmt(r.get('backward_ms'))} | {_fmt(p.get('forward_ms'))}/{_fmt(p.get('backward_ms'))}"
                     f" ({p.get('kernel', '')}) | {r.get('attention', '')} |")  # fmt: skip
    return lines + [""]


def _decisive_checks(data: dict[str, Any]) -> list[str]:
    lines = ["## Checks (child process)", "", "| check | result | value | limit | attention ran | detail |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for c in data["checks"]:
        lines.append(f"| {c['name']} | {RESULT[c['passed']]} | {_fmt(c.get('value'))} | {_fmt(c.get('limit'))} |"
                     f" {c.get('attention', '')} | {c.get('detail', '')} |")  # fmt: skip
    return lines + [""]


def _calibration(data: dict[str, Any]) -> list[str]:
    cal = data.get("calibration") or {}
    if not cal:
        return []
    lines = ["## Calibration", "", f"`{cal.get('command', '')}`: {cal.get('status', 'running')}", ""]
    values = cal.get("values") or {}
    if values:
        lines += ["| term | calibrated | planned with |", "|---|---|---|"]
        lines += [f"| {k} | {_fmt(v['calibrated'])} | {_fmt(v['planned_with'])} |" for k, v in values.items()]
    return lines + [""]
