"""``sppo-plan``: choose (SP, PP, N, alpha) for a model, a sequence length and a cluster.

    sppo-plan --model gpt-7b --seq-len 1M --nodes 4 --gpus-per-node 8 --gpu a100-80gb
    sppo-plan --model gpt-65b --seq-len 512K --nodes 16 --gpu h200 --json
    sppo-plan --model gpt-13b --seq-len 1M --nodes 8 --sp 8 --pp 8 --offload full --fsdp-sync step   # assess one
    sppo-plan --model gpt-65b --seq-len 768K --nodes 16 --sp 8 --pp 16 --num-subsequences 160   # what about N=160?
    sppo-plan --model gpt-7b --seq-len 16K --nodes 1 --pp 4 --schedule sppo     # only the "sppo" schedule
    sppo-plan --model gpt-65b --seq-len 1M --nodes 16 --kv-grad-dtype bf16   # lossy bf16 dK/dV accumulators
    sppo-plan --model llama-3.1-8b --seq-len 128K --nodes 1 --document-length 8K  # packed, masked documents
    sppo-plan --model llama-3.2-1b --seq-len 256K --nodes 1   # past the preset's 128K: planned with block_size=256K
    sppo-plan --model llama-3.1-8b --seq-len 2M --nodes 1 --gpu h100 --recompute full --model-state device
    sppo-plan --model llama-3.1-8b --nodes 1 --gpus-per-node 8 --gpu h100 --max-seq-len   # how long can I go?
    sppo-plan --model llama-3.1-8b --nodes 1 --gpus-per-node 1 --gpu h100 --max-seq-len --host-memory 1T
    sppo-plan --model llama-3.1-8b --nodes 1 --gpus-per-node 1 --gpu h100 --max-seq-len --max-step-time 600
    sppo-plan --calibrate --out my-gpu.json          # then: --gpu my-gpu.json (about a minute on a GPU)
    sppo-plan --calibrate --device cpu --quick --out cpu.json   # the same measurements on CPU, tiny sizes
    sppo-plan --fit-suite benchmarks/results/gpu_suite/gpu_suite.json --out fitted.json   # then: --gpu fitted.json

Exit status: 0 with a plan; 1 when nothing fits (the reason on one stderr line); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.parallel.fsdp import FSDP_SYNC_MODES
from lightning_sppo.planner.evaluate import OFFLOAD_ORDER, SCHEDULE_ORDER
from lightning_sppo.planner.longest import DEFAULT_GRANULARITY, Longest, longest_sequence
from lightning_sppo.planner.options import DEFAULT_KV_CHUNK_TOKENS, KV_AUTO, MODEL_STATE_ORDER, RECOMPUTE_ORDER
from lightning_sppo.planner.plan import ORDERS, NoFeasiblePlan, PlanRequest
from lightning_sppo.planner.precision import KV_GRAD_DTYPES, PRECISIONS
from lightning_sppo.planner.profile import BUILTIN_PROFILES, DEFAULT_HOST_BYTES_PER_NODE, resolve_profile
from lightning_sppo.planner.report import format_longest, format_plan
from lightning_sppo.planner.solver import solve
from lightning_sppo.planner.units import format_bytes, parse_bytes, parse_tokens

__all__ = ["main"]

PROG = "sppo-plan"
EXIT_NO_FIT = 1
EXIT_USAGE = 2


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument on one line, not usage plus message."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=GPTConfig.available(), help="registered model name")
    p.add_argument("--seq-len", help="tokens per sequence: 512K, 1M, 1.28M or 1048576 (K, M are binary)")
    p.add_argument(
        "--block-size", default=None,
        help="the model's block_size in the run (its model_overrides.block_size); default: the preset's, raised to"
        " --seq-len when shorter (continued pretraining past a model's context: positions cost no memory)",
    )  # fmt: skip
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the profile's, 8)")
    p.add_argument(
        "--gpu", default=None,
        help=f"built-in profile {sorted(BUILTIN_PROFILES)} or a profile JSON file (default a100-80gb; with --fit-suite:"
        " the profile to start from, default the suite's GPU)",
    )  # fmt: skip
    p.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS, help="see lightning_sppo.planner.precision")
    p.add_argument("--sp", type=int, default=None, help="fix the sequence-parallel size (default: search)")
    p.add_argument("--pp", type=int, default=None, help="fix the pipeline-parallel size (default: search)")
    p.add_argument(
        "--num-subsequences", type=int, default=None, metavar="N",
        help="fix N, the subsequences each sequence is cut into (default: search, from the cost model)",
    )  # fmt: skip
    p.add_argument("--offload", choices=("auto", *OFFLOAD_ORDER), default="auto", help="offload policy (auto: search)")
    p.add_argument(
        "--fsdp-sync", choices=("auto", *FSDP_SYNC_MODES), default="auto",
        help="when sharded stages gather weights and reduce gradients (auto: search; see parallel/fsdp.py)",
    )  # fmt: skip
    p.add_argument(
        "--schedule", choices=("auto", *SCHEDULE_ORDER), default="auto",
        help="pipeline schedule (auto: search both; sppo: multiplexed sequence partitioning, weights streamed per layer)",
    )  # fmt: skip
    p.add_argument(
        "--order", choices=("auto", *ORDERS), default="auto",
        help="how the GPUs run a step (auto: both orders at every layout, the faster per sequence; subsequence:"
        " SPPO's; layer: FPDT's, each layer over the whole sequence in chunks, one stage, order='layer')",
    )  # fmt: skip
    p.add_argument(
        "--kv-grad-dtype", choices=list(KV_GRAD_DTYPES), default="fp32",
        help="dtype of the K/V cache's dK/dV accumulators (bf16: 2 bytes less per element, lossy; default fp32)",
    )  # fmt: skip
    p.add_argument(
        "--document-length", default=None,
        help="mean length of packed documents under document masking (8K, 32768): attention is counted only inside"
             " them (default: each sequence is one document)",
    )  # fmt: skip
    p.add_argument(
        "--recompute", choices=("auto", *RECOMPUTE_ORDER), default="auto",
        help="what blocks recompute in backward (auto: none when the run fits without, else the fastest that fits)",
    )  # fmt: skip
    p.add_argument(
        "--kv-device-tokens", default="auto",
        help="tokens of each layer's K/V kept on the device, the rest on host: auto (all when they fit, else the"
        " largest prefix that fits), all, or a count such as 256K",
    )  # fmt: skip
    p.add_argument(
        "--kv-chunk-tokens", default=str(DEFAULT_KV_CHUNK_TOKENS), help="tokens per chunk of spilled K/V streamed back"
    )
    p.add_argument(
        "--model-state", choices=("auto", *MODEL_STATE_ORDER), default="auto",
        help="where parameters, gradients and AdamW live (auto: device when it fits, else the fastest that fits)",
    )  # fmt: skip
    p.add_argument(
        "--host-memory", default=None,
        help=f"host memory per node, e.g. 2T or 512G (binary units; default {format_bytes(DEFAULT_HOST_BYTES_PER_NODE)}"
        " for the built-in profiles); 7/8 of it is shared by the node's GPUs",
    )  # fmt: skip
    p.add_argument(
        "--max-seq-len", action="store_true",
        help=f"print the longest sequence that fits (a multiple of {DEFAULT_GRANULARITY} tokens) and its plan,"
        " instead of planning --seq-len",
    )  # fmt: skip
    p.add_argument(
        "--max-step-time", type=float, default=None, metavar="SECONDS",
        help="with --max-seq-len: the longest sequence whose predicted step takes at most this many seconds",
    )  # fmt: skip
    p.add_argument(
        "--attention", choices=("auto", "sdpa", "cudnn", "flash_attn"), default="auto",
        help="the engine's attention backend the run will use (auto: what attention='auto' runs on this GPU)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--calibrate", action="store_true", help="measure this GPU and write a profile JSON, then exit")
    p.add_argument(
        "--device", default=None,
        help="with --calibrate: the device to measure (default the current CUDA GPU; cpu measures this CPU's terms)",
    )  # fmt: skip
    p.add_argument(
        "--quick", action="store_true", help="with --calibrate: tiny sizes in seconds (checks the code; not a profile)"
    )
    p.add_argument(
        "--fit-suite", metavar="SUITE_JSON", default=None,
        help="fit the profile's constants to the steps benchmarks/gpu_suite.py measured (its gpu_suite.json), print"
        " predicted vs measured for every run, write the profile to --out, then exit",
    )  # fmt: skip
    p.add_argument(
        "--out", default="sppo-profile.json", help="where --calibrate and --fit-suite write (default sppo-profile.json)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sppo-plan`` console script; returns the exit status."""
    try:
        args = _parser().parse_args(argv)
        if args.calibrate or args.fit_suite is not None:
            _check_out(args.out)
        if args.calibrate:
            return _calibrate(args.out, args.device, args.quick)
        if args.fit_suite is not None:
            return _fit_suite(args.fit_suite, args.gpu, args.out)
        request = _request(args)
    except (_UsageError, ValueError) as error:
        return _fail(f"error: {error}", EXIT_USAGE)
    try:
        if args.max_seq_len:
            longest = longest_sequence(request, limit=_block_size(args), max_step_time_s=args.max_step_time)
        else:
            plan = solve(request)
    except NoFeasiblePlan as error:
        return _fail(str(error), EXIT_NO_FIT)
    if args.max_seq_len:
        _print(json.dumps(_longest_dict(longest)) if args.json else format_longest(longest))
    else:
        _print(json.dumps(plan.to_dict()) if args.json else format_plan(plan))
    return 0


def _longest_dict(longest: Longest) -> dict:
    return {
        "max_seq_len": longest.seq_len, "step_time_s": longest.plan.step_time_s, "granularity": longest.granularity,
        "seconds": longest.seconds, "probes": longest.probes, "limited_by_block_size": longest.limit,
        "max_step_time_s": longest.max_step_time_s, "memory_max_seq_len": longest.memory_seq_len,
        "memory_step_time_s": longest.memory_step_time_s, "plan": longest.plan.to_dict(),
    }  # fmt: skip


def _block_size(args: argparse.Namespace) -> int | None:
    return None if args.block_size is None else parse_tokens(args.block_size, "--block-size")


def _print(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # the reader (``| head``) left early: not an error, and no traceback at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _request(args: argparse.Namespace) -> PlanRequest:
    needed = (("--model", args.model),) + ((("--seq-len", args.seq_len),) if not args.max_seq_len else ())
    missing = [flag for flag, value in needed if value is None]
    if missing:
        raise _UsageError(
            f"{' and '.join(missing)} required (or --calibrate, or --fit-suite; --max-seq-len needs no --seq-len)"
        )
    if args.max_seq_len and args.seq_len is not None:
        raise _UsageError("--max-seq-len finds the length itself: drop --seq-len")
    if args.max_step_time is not None and (not args.max_seq_len or not args.max_step_time > 0):
        raise _UsageError(
            f"--max-step-time={args.max_step_time:g} needs --max-seq-len and a number of seconds > 0, e.g. 600"
        )
    config = GPTConfig.from_name(args.model)
    seq_len = parse_tokens(args.seq_len) if not args.max_seq_len else min(config.block_size, DEFAULT_GRANULARITY)
    block_size = max(config.block_size, seq_len) if args.block_size is None else _block_size(args)
    host = None if args.host_memory is None else parse_bytes(args.host_memory, "--host-memory")
    _check_node_size(args.gpu or "a100-80gb", args.gpus_per_node)
    return PlanRequest(
        config=replace(config, block_size=block_size),
        seq_len=seq_len,
        nodes=args.nodes,
        profile=resolve_profile(args.gpu or "a100-80gb", args.gpus_per_node, host),
        precision=args.precision,
        sp=args.sp,
        pp=args.pp,
        num_subsequences=args.num_subsequences,
        offload=OFFLOAD_ORDER if args.offload == "auto" else (args.offload,),
        fsdp_sync=FSDP_SYNC_MODES if args.fsdp_sync == "auto" else (args.fsdp_sync,),
        schedule=SCHEDULE_ORDER if args.schedule == "auto" else (args.schedule,),
        kv_grad_dtype=args.kv_grad_dtype,
        document_length=None
        if args.document_length is None
        else parse_tokens(args.document_length, "--document-length"),
        recompute=RECOMPUTE_ORDER if args.recompute == "auto" else (args.recompute,),
        model_state=MODEL_STATE_ORDER if args.model_state == "auto" else (args.model_state,),
        kv_device_tokens=_kv_device_tokens(args.kv_device_tokens),
        kv_chunk_tokens=parse_tokens(args.kv_chunk_tokens, "--kv-chunk-tokens"),
        attention=args.attention,
        order=ORDERS if args.order == "auto" else (args.order,),
    )


def _check_node_size(gpu: str, gpus_per_node: int | None) -> None:
    """A built-in profile describes a node of its own size (8 GPUs in one NVLink domain: ``intra_node_gbps``, the
    host memory shared by 8): a larger node is another machine, which only a profile of it can describe."""
    builtin = BUILTIN_PROFILES.get(gpu)
    if builtin is None or gpus_per_node is None or gpus_per_node <= builtin.gpus_per_node:
        return
    raise _UsageError(
        f"--gpus-per-node={gpus_per_node}: the built-in {gpu} profile describes nodes of up to"
        f" {builtin.gpus_per_node} GPUs (their NVLink and host memory); give --gpus-per-node 1 to"
        f" {builtin.gpus_per_node}, or --gpu FILE.json, a profile of your node with its gpus_per_node (sppo-plan"
        " --calibrate writes one)"
    )


def _kv_device_tokens(text: str) -> int | str | None:
    """``auto``, ``all`` (None: every token on the device) or a token count (0 allowed: all K/V on host)."""
    value = text.strip().lower()
    if value == KV_AUTO:
        return KV_AUTO
    if value == "all":
        return None
    if value == "0":
        return 0
    return parse_tokens(text, "--kv-device-tokens")


def _check_out(out: str) -> None:
    """``--out`` must be a file this command can write, checked before the minutes of measuring or fitting."""
    path = Path(out)
    if path.is_dir():
        raise _UsageError(
            f"--out={out!r} is a folder; name the profile JSON file to write, e.g. --out {path / 'profile.json'}"
        )
    blocked = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), None)
    if blocked is not None:
        raise _UsageError(f"--out={out!r}: {str(blocked)!r} is a file, not a folder; choose another --out.")


def _calibrate(out: str, device: str | None, quick: bool) -> int:
    from lightning_sppo.planner.calibrate import CalibrationUnavailable, calibrate

    try:
        profile = calibrate(device, quick)
    except CalibrationUnavailable as error:
        return _fail(str(error), EXIT_NO_FIT)
    profile.save(out)
    _print(f"wrote {out}: {json.dumps(profile.to_dict())}")
    return 0


def _fit_suite(suite_path: str, gpu: str | None, out: str) -> int:
    """``--fit-suite``: the fitted constants, predicted vs measured per run, and the profile written to ``out``."""
    from lightning_sppo.planner.fit import base_profile, fit_suite, format_fit, load_suite

    suite = load_suite(suite_path)
    result = fit_suite(suite, resolve_profile(gpu) if gpu is not None else base_profile(suite))
    _print(format_fit(result))
    result.profile.save(out)
    _print(f"wrote {out}: use it with --gpu {out}")
    return 0


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
