"""Bytes kept per token per layer, as the runtime holds them, beside the planner's prediction (issue 21).

For each recompute mode ("none", "selective", "full") and K/V on the device or spilled to host (a quarter of the
sequence kept on the device), one ``SubsequenceEngine`` step of a small GPT is measured:

* level 2: what the blocks keep for backward (the offloader's count of saved units, every size included), per
  token and layer: the step of a model with ``2L`` layers minus the step with ``L``, over ``L`` layers and ``S``
  tokens, so what a stage keeps besides its blocks (RoPE tables, the head) cancels;
* level 1 on the device and on host: the K/V caches' bytes (K, V and the fp32 dK/dV buffers), over layers and tokens.

The planner's numbers come from the functions the solver charges (``planner.activations``, ``planner.memory``).
Level 2 is where it lives only by the offload policy: on the device with offload "none", on host at alpha.

Run:  python benchmarks/bytes_per_token.py --out benchmarks/results     # CPU, under a minute
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.model.gpt import GPT
from lightning_sppo.offload import build_offloader
from lightning_sppo.partition import split_sequence
from lightning_sppo.planner import precision_bytes
from lightning_sppo.planner.activations import layer_saved_bytes_per_token
from lightning_sppo.planner.layout import stage_specs
from lightning_sppo.planner.memory import kv_spill_bytes
from lightning_sppo.planner.options import DEFAULT_KV_CHUNK_TOKENS
from lightning_sppo.recompute import RECOMPUTE_MODES, apply_recompute
from lightning_sppo.runtime import SubsequenceEngine

LAYERS = 2
"""Layers of the smaller model; the larger has twice as many."""


@dataclass(frozen=True)
class Case:
    recompute: str
    spill: bool
    precision: str = "fp32"


def measure_step(config: GPTConfig, case: Case, seq_len: int, n: int) -> dict[str, int]:
    """Level-2 bytes and level-1 device/host bytes of one engine step of ``config``."""
    torch.manual_seed(0)
    model = apply_recompute(GPT(config), case.recompute)
    ids = torch.randint(config.vocab_size, (1, seq_len))
    hooks = build_offloader("full", "cpu", min_bytes=0)  # counts every saved unit; sends it to host (CPU: a copy)
    engine = SubsequenceEngine(n, "length", hooks=hooks, kv_device_tokens=seq_len // 4 if case.spill else None)
    bf16 = case.precision == "bf16-mixed"
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else nullcontext
    engine.forward_backward(model, ids, ids, forward_context=context)
    return {
        "level2": hooks.last_stats.level2_bytes,
        "level1_device": engine.cache_peak_nbytes(),  # K/V and dK/dV at their most, during the backward
        "level1_host": engine.cache_host_nbytes(),
    }


def measured_per_token_layer(config: GPTConfig, case: Case, seq_len: int, n: int) -> dict[str, float]:
    small = measure_step(replace(config, n_layer=LAYERS), case, seq_len, n)
    large = measure_step(replace(config, n_layer=2 * LAYERS), case, seq_len, n)
    per = LAYERS * seq_len
    return {
        "level2": (large["level2"] - small["level2"]) / per,
        "level1_device": large["level1_device"] / (2 * per),
        "level1_host": large["level1_host"] / (2 * per),
    }


def predicted_per_token_layer(config: GPTConfig, case: Case, seq_len: int, n: int) -> dict[str, float]:
    """What the solver charges (one stage of every layer, sp = 1), per token and layer: dK/dV for the tokens before
    the last subsequence (later subsequences add to those only)."""
    dtypes = precision_bytes(case.precision)
    stage = stage_specs(config, 1)[0]
    device_tokens = seq_len // 4 if case.spill else None
    last_offset = seq_len - split_sequence(seq_len, n, "length")[-1]
    kv, grad, _, host = kv_spill_bytes(
        config, dtypes, stage, seq_len, 1, 1, device_tokens, DEFAULT_KV_CHUNK_TOKENS, last_offset
    )
    per = stage.layers * seq_len
    return {
        "level2": layer_saved_bytes_per_token(config, dtypes, 1, case.recompute),
        "level1_device": (kv + grad) / per,
        "level1_host": host / per,
    }


def run(config: GPTConfig, seq_len: int, n: int, precisions: tuple[str, ...]) -> list[dict]:
    rows = []
    for precision in precisions:
        for recompute in RECOMPUTE_MODES:
            for spill in (False, True):
                case = Case(recompute, spill, precision)
                measured = measured_per_token_layer(config, case, seq_len, n)
                predicted = predicted_per_token_layer(config, case, seq_len, n)
                rows.append({"precision": precision, "recompute": recompute, "kv_spill": spill,
                             "measured": measured, "predicted": predicted})  # fmt: skip
    return rows


def markdown(rows: list[dict], config: GPTConfig, seq_len: int, n: int) -> str:
    lines = [
        "# Bytes per token per layer: runtime vs planner (CPU)",
        "",
        f"Model: {config.name or 'custom'} (d={config.n_embd}, {config.n_head} heads, {config.n_query_groups} K/V"
        f" groups of {config.head_size}), S={seq_len}, N={n}; K/V spill keeps S/4 tokens on the device.",
        "Level 2 lives on the device or on host by the offload policy; level 1 is K/V + dK/dV.",
        "",
        "| precision | recompute | K/V spill | level 2 measured | predicted | level 1 device measured | predicted"
        " | level 1 host measured | predicted |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        m, p = r["measured"], r["predicted"]
        lines.append(
            f"| {r['precision']} | {r['recompute']} | {'on' if r['kv_spill'] else 'off'} | {m['level2']:.1f}"
            f" | {p['level2']:.1f} | {m['level1_device']:.1f} | {p['level1_device']:.1f} | {m['level1_host']:.1f}"
            f" | {p['level1_host']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-gqa")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    config = GPTConfig.from_name(args.model)
    rows = run(config, args.seq_len, args.n, ("fp32", "bf16-mixed"))
    text = markdown(rows, config, args.seq_len, args.n)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bytes_per_token.json").write_text(json.dumps(rows, indent=2) + "\n")
        (args.out / "bytes_per_token.md").write_text(text)


if __name__ == "__main__":
    main()
