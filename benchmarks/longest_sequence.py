"""How long can Llama-3.1-8B go? ``sppo-plan --max-seq-len`` on one and eight H100-80GB and eight H200, and on one
H100 within 600 s per step (``--max-step-time 600``).

For each setup it runs ``longest_sequence`` (the bisection ``sppo-plan --max-seq-len`` runs: the longest multiple of
1024 tokens at which the leanest configuration fits in either order of a step, then the fastest plan there), and
again with only the order that did not win (``--order subsequence`` or ``--order layer``), with 2 TiB of host memory
per node (the built-in profiles' default, 7/8 of it usable), and writes the length, the plan's layout, recompute, K/V spill
and model state, its GPU and host memory and predicted tokens/s and MFU, beside what ALST (Arctic Long Sequence
Training: 500K on one H100, 3.7M on eight) and UPipe (5M on eight H100) report on the same hardware. It also writes
the bytes this project keeps per token and layer, by recompute mode, beside ALST's one hidden state (2 d bytes).

Predictions only (the planner's memory and time models; no GPU runs).

Run:  python benchmarks/longest_sequence.py        # writes benchmarks/results/longest_sequence.{md,json}
"""

from __future__ import annotations

import datetime
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_sppo import GPTConfig  # noqa: E402
from lightning_sppo.planner import PlanRequest, precision_bytes, resolve_profile  # noqa: E402
from lightning_sppo.planner.activations import kv_cache_bytes_per_layer, layer_saved_bytes_per_token  # noqa: E402
from lightning_sppo.planner.longest import longest_sequence  # noqa: E402
from lightning_sppo.planner.options import RECOMPUTE_ORDER  # noqa: E402
from lightning_sppo.planner.units import format_bytes, format_tokens  # noqa: E402

MODEL = "llama-3.1-8b"
SETUPS = [("h100", 1, None), ("h100", 1, 600.0), ("h100", 8, None), ("h200", 8, None)]
"""(GPU, GPUs, step-time limit in seconds: ``--max-step-time``, or None)."""
ANCHORS = {
    ("h100", 1): "ALST 500K",
    ("h100", 8): "ALST 3.7M, UPipe 5M",
    ("h200", 8): "",
}
"""What others report on the same hardware (ALST: arXiv 2506.13996; UPipe / Untied Ulysses)."""
OUT = ROOT / "benchmarks" / "results" / "longest_sequence"


def longest_rows() -> list[dict]:
    rows = []
    for gpu, gpus, limit in SETUPS:
        profile = resolve_profile(gpu, gpus)
        request = PlanRequest(config=GPTConfig.from_name(MODEL), seq_len=1024, nodes=1, profile=profile)
        found = longest_sequence(request, max_step_time_s=limit)
        plan = found.plan
        other = "subsequence" if plan.order == "layer" else "layer"
        alone = longest_sequence(replace(request, order=(other,)), max_step_time_s=limit)
        order = "order=layer, " if plan.order == "layer" else ""
        rows.append({
            "gpu": gpu, "gpus": gpus, "max_step_time_s": limit, "max_seq_len": found.seq_len,
            "planning_s": round(found.seconds, 1), "order": plan.order,
            "other_order": {"order": other, "max_seq_len": alone.seq_len, "mfu": alone.plan.mfu,
                            "step_time_s": alone.plan.step_time_s},
            "host_bytes_per_node": profile.host_bytes_per_node,
            "layout": f"{order}sp={plan.sp} pp={plan.pp} dp={plan.dp}",
            "num_subsequences": plan.num_subsequences, "recompute": plan.recompute,
            "kv_device_tokens": plan.kv_device_tokens, "model_state": plan.model_state, "offload": plan.offload,
            "fsdp_sync": plan.fsdp_sync, "peak_gpu_bytes": plan.peak_gpu_bytes, "gpu_bytes": plan.gpu_bytes,
            "peak_host_bytes": plan.peak_host_bytes, "host_limit_bytes": plan.host_limit_bytes,
            "tokens_per_gpu_per_s": plan.tokens_per_gpu_per_s, "mfu": plan.mfu, "step_time_s": plan.step_time_s,
            "others": "" if limit else ANCHORS[(gpu, gpus)],
        })  # fmt: skip
    return rows


def bytes_rows() -> list[dict]:
    """Per token and layer (one GPU's share with sp = 1; bf16 as the runtime runs it under FSDP): level 2 kept by
    each recompute mode, level 1 (K/V + fp32 dK/dV), against ALST's one bf16 hidden state."""
    config = GPTConfig.from_name(MODEL)
    dtypes = precision_bytes("bf16-mixed", sharded=True)
    kv, grad = kv_cache_bytes_per_layer(config, dtypes, 1)
    rows = []
    for mode in RECOMPUTE_ORDER:
        level2 = layer_saved_bytes_per_token(config, dtypes, 1, mode)
        rows.append({"recompute": mode, "level2": level2, "kv": kv, "kv_grad": grad, "total": level2 + kv + grad})
    rows.append({"recompute": "ALST (one hidden state)", "level2": 2 * config.n_embd, "kv": 0, "kv_grad": 0,
                 "total": 2 * config.n_embd})  # fmt: skip
    return rows


def _other(row: dict) -> str:
    other = row["other_order"]
    return (
        f"{other['order']}: {format_tokens(other['max_seq_len'])} ({other['mfu']:.1%} MFU,"
        f" {other['step_time_s']:.0f} s)"
    )


def markdown(longest: list[dict], per_token: list[dict]) -> str:
    lines = [
        f"# Longest sequence for {MODEL} (`sppo-plan --max-seq-len`, 2 TiB host memory per node)",
        "",
        "| GPUs | longest | layout, N | recompute | K/V on device | model state | GPU / host per GPU | tokens/GPU/s"
        " | MFU | step | the other order alone | others report |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in longest:
        kv = "all" if r["kv_device_tokens"] is None else format_tokens(r["kv_device_tokens"])
        limit = f", within {r['max_step_time_s']:g} s per step" if r["max_step_time_s"] else ""
        lines.append(
            f"| {r['gpus']} x {r['gpu']}{limit} | **{format_tokens(r['max_seq_len'])}** ({r['max_seq_len']}) |"
            f" {r['layout']}, N={r['num_subsequences']} | {r['recompute']} | {kv} | {r['model_state']} |"
            f" {format_bytes(r['peak_gpu_bytes'])} / {format_bytes(r['peak_host_bytes'])} |"
            f" {r['tokens_per_gpu_per_s']:.0f} | {r['mfu']:.1%} | {r['step_time_s']:.0f} s | {_other(r)} |"
            f" {r['others']} |"
        )
    lines += [
        "",
        f"Planning time per setup (s): {', '.join(str(r['planning_s']) for r in longest)}.",
        "",
        "## Bytes kept per token and layer (llama-3.1-8b, bf16, one GPU's share)",
        "",
        "| recompute | level 2 kept (device, or host by alpha) | K/V (device, or host past R) | dK/dV fp32 | total |",
        "|---|---|---|---|---|",
    ]
    for r in per_token:
        lines.append(f"| {r['recompute']} | {r['level2']} | {r['kv']} | {r['kv_grad']} | {r['total']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    longest, per_token = longest_rows(), bytes_rows()
    OUT.with_suffix(".md").write_text(markdown(longest, per_token))
    meta = {"date": datetime.date.today().isoformat(), "model": MODEL}
    OUT.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "longest": longest, "per_token": per_token}, indent=2)
    )
    print(OUT.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
