"""Op census: every ATen op one training step issues, with its dtypes, shapes and bytes (CPU-runnable).

Compares the engine (``SubsequenceEngine``) at N subsequences with the plain model doing the same step (the same
chunked loss, bf16 autocast on CPU), op by op, to find what the engine adds. What a GPU would run is what the
census sees: a ``TorchDispatchMode`` below autograd and autocast records every ATen call.

* kinds: matmuls (must be the plain model's: op, shapes, dtypes, count, FLOPs), attention (ATen's fused attention
  ops: the plain model reaches them through ``F.scaled_dot_product_attention`` and its autograd, the engine calls
  the op pair itself), free (views, detaches, allocations: no data moved) and other;
* where: "attention" for ops issued by ``lightning_sppo.attention`` (the subsequence function, the K/V cache, the
  kernels), "model" for everything else (the model's own forward, autograd's backward of it, the loss, the engine's
  bookkeeping).

Bytes are what an op's tensor arguments and results hold (every input read once, every output written once; an
in-place op's tensor counts as read and written), which is the HBM traffic a GPU pays if the op runs as one kernel.
On CPU the engine and the plain model run at the same speed, so what costs time on a GPU is found by counting.

The budgets (``check_n1``, ``check_n``) are the engine's contract, and ``tests/runtime/test_op_census.py`` holds it:

* N = 1: the plain model's matmuls and attention ops; outside the attention path at most ``PER_STEP_BYTES_PER_TOKEN``
  bytes per token per step (the loss normaliser); inside it at most one copy of V per layer (``n1_budget``: the
  last subsequence's K is kept by reference, V copied out of the fused qkv projection, ``attention.kv_cache``).
* N > 1: the same matmul FLOPs; the attention path's extra bytes bounded by what each later subsequence's K/V reads
  and dK/dV sums cost (``kv_budget``); outside it, the weight gradients of each extra backward added to ``.grad``
  (``weight_budget``).

    python benchmarks/op_census.py                         # `small`, 1024 tokens, N = 1 and 4 (writes JSON)
    python benchmarks/op_census.py --model tiny --seq-len 256 --num-subsequences 1 2 --out /tmp/census.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

import lightning_sppo
from lightning_sppo.loss import chunked_cross_entropy
from lightning_sppo.model.config import GPTConfig
from lightning_sppo.model.gpt import GPT
from lightning_sppo.partition import spans as to_spans
from lightning_sppo.runtime import SubsequenceEngine

__all__ = [
    "Census",
    "OpRecord",
    "check_n",
    "check_n1",
    "compare",
    "engine_step",
    "kv_budget",
    "n1_budget",
    "plain_step",
    "record",
    "weight_budget",
]

MATMULS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm"})
ATTENTION_MARKERS = ("scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")
# Ops that move no data: metadata, aliases, allocations without a fill.
FREE = frozenset({"aten.detach", "aten.alias", "aten.empty", "aten.empty_strided", "aten.empty_like",
                  "aten.lift_fresh", "aten.set_", "aten.resize_", "aten._local_scalar_dense", "aten._unsafe_view",
                  "aten._reshape_alias", "aten.promote_types", "aten._fused_sdp_choice"})  # fmt: skip
PER_STEP_BYTES_PER_TOKEN = 16
"""The engine's per-step ops outside attention (counting the valid targets: a compare and a sum over the targets)."""

_PACKAGE = str(Path(lightning_sppo.__file__).parent)
_ATTENTION = str(Path(lightning_sppo.__file__).parent / "attention")


@dataclass(frozen=True)
class OpRecord:
    """One ATen call: ``op`` (overload packet, e.g. ``aten.mm``), its tensor inputs and outputs as (dtype, shape),
    the bytes they hold, the matmul FLOPs (0 for others), its kind and where it was issued from."""

    op: str
    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    outputs: tuple[tuple[str, tuple[int, ...]], ...]
    nbytes: int
    flops: int
    kind: str
    where: str

    @property
    def key(self) -> tuple:
        """What makes two calls the same call: op, shapes and dtypes."""
        return self.op, self.inputs, self.outputs


def _tensors(tree) -> list[Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, Tensor)]


def _signature(tensors: Iterable[Tensor]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors)


def classify(op: str, func) -> str:
    """matmul, attention, free (no data moved: views, detaches, allocations) or other."""
    if op in MATMULS:
        return "matmul"
    if any(marker in op for marker in ATTENTION_MARKERS):
        return "attention"
    if op in FREE or func.is_view:
        return "free"
    return "other"


def _where() -> str:
    """ "attention" when the innermost ``lightning_sppo`` frame issuing the op is in ``lightning_sppo.attention``."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE):
            return "attention" if name.startswith(_ATTENTION) else "model"
        frame = frame.f_back
    return "model"


class Census(TorchDispatchMode):
    """Records every ATen op below autograd and autocast (what a device would run) while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[OpRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = f"aten.{func.overloadpacket.__name__}"
        kind = classify(op, func)
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        nbytes = 0 if kind == "free" else sum(t.numel() * t.element_size() for t in (*inputs, *outputs))
        flops = 0
        if kind == "matmul" and func.overloadpacket in flop_registry:
            flops = int(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
        self.records.append(OpRecord(op, _signature(inputs), _signature(outputs), nbytes, flops, kind, _where()))
        return out


def record(step: Callable[[], None]) -> list[OpRecord]:
    """The ops of one call of ``step``."""
    with Census() as census:
        step()
    return census.records


# -- the two steps --------------------------------------------------------------------------------------------


def _autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else nullcontext()


def plain_step(model: GPT, ids: Tensor, targets: Tensor, autocast: bool = True) -> Callable[[], None]:
    """The plain model's training step with the engine's chunked loss (no [S, vocab] logits), as the GPU suite runs
    it: forward under autocast, backward outside it."""

    def step() -> None:
        with _autocast(autocast):
            hidden = model.hidden_states(ids)
            loss = chunked_cross_entropy(hidden, model.lm_head.weight, targets, targets.numel())
        loss.backward()

    return step


def engine_step(
    model: GPT, ids: Tensor, targets: Tensor, engine: SubsequenceEngine, autocast: bool = True
) -> Callable[[], None]:
    """The engine's training step with the forwards under autocast."""
    return lambda: engine.forward_backward(model, ids, targets, forward_context=lambda: _autocast(autocast))


def steady(step: Callable[[], None], model: GPT) -> Callable[[], None]:
    """``step`` run once (one-time probes and caches out of the way), then run again from no gradients: the census
    sees a steady-state step whose gradients are assigned, not accumulated across steps."""
    step()

    def fresh() -> None:
        model.zero_grad(set_to_none=True)
        step()

    return fresh


# -- comparing them -------------------------------------------------------------------------------------------


def _select(records: Iterable[OpRecord], kind: str, where: str | None = None) -> list[OpRecord]:
    return [r for r in records if r.kind == kind and (where is None or r.where == where)]


def _rows(counts: Counter, index: dict[tuple, OpRecord]) -> list[dict]:
    rows = [
        {"op": key[0], "inputs": index[key].inputs, "outputs": index[key].outputs, "count": n,
         "bytes": n * index[key].nbytes}
        for key, n in counts.items()
    ]  # fmt: skip
    return sorted(rows, key=lambda r: -r["bytes"])


def _diff(plain: list[OpRecord], engine: list[OpRecord]) -> dict:
    index = {r.key: r for r in (*plain, *engine)}
    p, e = Counter(r.key for r in plain), Counter(r.key for r in engine)
    return {"extra": _rows(e - p, index), "missing": _rows(p - e, index)}


def _bytes(records: Iterable[OpRecord]) -> int:
    return sum(r.nbytes for r in records)


def compare(plain: list[OpRecord], engine: list[OpRecord]) -> dict:
    """The engine against the plain model: per kind (and for other ops per where) the calls the engine makes beyond
    (``extra``) and short of (``missing``) the plain model, and the bytes of each part."""
    other_model = _select(engine, "other", "model")
    result = {
        "matmul": _diff(_select(plain, "matmul"), _select(engine, "matmul")),
        "attention": _diff(_select(plain, "attention"), _select(engine, "attention")),
        "other (model)": _diff(_select(plain, "other"), other_model),
        "other (attention path)": _diff([], _select(engine, "other", "attention")),
    }
    result["bytes"] = {
        "matmul_flops": {"plain": sum(r.flops for r in plain), "engine": sum(r.flops for r in engine)},
        "attention": {"plain": _bytes(_select(plain, "attention")), "engine": _bytes(_select(engine, "attention"))},
        "other (model)": {"plain": _bytes(_select(plain, "other")), "engine": _bytes(other_model)},
        "other (attention path)": {"plain": 0, "engine": _bytes(_select(engine, "other", "attention"))},
    }
    return result


def extra_bytes(result: dict, part: str) -> int:
    """Engine minus plain bytes of one part of a ``compare`` result ("attention", "other (model)", ...)."""
    return result["bytes"][part]["engine"] - result["bytes"][part]["plain"]


# -- budgets ----------------------------------------------------------------------------------------------------


def _itemsize(autocast: bool) -> int:
    return 2 if autocast else 4


def n1_budget(config: GPTConfig, batch: int, seq_len: int, autocast: bool = True) -> int:
    """Attention-path bytes the engine may add at N = 1, per layer: one copy of V ([B, G, S, Dh]) into the cache,
    counted as the copy op is (destination and source read, destination written: 3 x V's bytes)."""
    return 3 * batch * seq_len * config.n_query_groups * config.head_size * _itemsize(autocast)


def kv_budget(config: GPTConfig, batch: int, lengths: list[int], autocast: bool = True) -> dict[str, int]:
    """Per layer, what N subsequences may add over N = 1: their K/V reads and dK/dV sums (and the query rows that
    go with them).

    With o_last the last subsequence's offset, and for subsequence i > 0 (offset o, length s): K/V of o tokens
    kv = 2 B G o Dh c bytes (c the compute dtype's size), their fp32 sums g = 2 B G o Dh 4, its queries' fp32 rows
    q = B H s Dh 4 and log-sum-exp rows l = B H s 4 (counting as the census does: inputs read, outputs written,
    in-place tensors both):

    * attention ops, per i > 0: the prefix forward reads K/V (kv) and the prefix backward reads them again and
      writes their dK/dV (2 kv); both read or write query rows in c bytes (q, out; dout, q, out, dq: 3 q) and the
      log-sum-exp (2 l): 3 kv + 3 q + 2 l;
    * other ops of the attention path, per i > 0: its prefix dK/dV added into the fp32 sums (read sums, read dK/dV,
      write sums: 2 g + kv); the forward merge of the two partial outputs in one fp32 buffer (upcast 1.5 q, scale
      2 q, multiply-add 2.5 q, round 1.5 q) and the dq sum in fp32 (upcast 1.5 q, add 2.5 q, round 1.5 q): 13 q;
      the weights of the merge from the log-sum-exps (logaddexp, two differences and exponentials): 16 l.
      Once for the tokens [0, o_last) (kv_last, g_last): their K copied into the cache (V is copied at N = 1 too:
      1.5 kv_last), the sums zeroed (2 g_last) and added once into those tokens' own dK/dV (g_last + 3 kv_last).
    """
    B, G, H, Dh, c = batch, config.n_query_groups, config.n_head, config.head_size, _itemsize(autocast)
    spans = to_spans(lengths)
    attention = other = 0
    for offset, length in spans[1:]:
        kv, g = 2 * B * G * offset * Dh * c, 2 * B * G * offset * Dh * 4
        q, lse = B * H * length * Dh * 4, B * H * length * 4
        attention += 3 * kv + 3 * q + 2 * lse
        other += 2 * g + kv + 13 * q + 16 * lse
    last = spans[-1][0]
    kv_last, g_last = 2 * B * G * last * Dh * c, 2 * B * G * last * Dh * 4
    other += 3 * kv_last // 2 + 2 * g_last + g_last + 3 * kv_last
    return {"attention": attention, "other (attention path)": other}


def weight_budget(model: GPT, num_subsequences: int) -> int:
    """Outside attention, what N backwards add over one: each extra backward makes every weight gradient once more
    and adds it to ``.grad`` (at most 24 bytes per parameter: the bf16 gradient cast to fp32, 6, the fp32 add, 12,
    and a re-cast of the weight for the loss head's recomputation, 6)."""
    return (num_subsequences - 1) * 24 * sum(p.numel() for p in model.parameters())


def n1_usage(result: dict, config: GPTConfig, batch: int, seq_len: int, autocast: bool = True) -> dict:
    """At N = 1, per part: (engine bytes beyond the plain model's, the budget)."""
    return {
        "other (model)": (extra_bytes(result, "other (model)"), PER_STEP_BYTES_PER_TOKEN * batch * seq_len),
        "other (attention path)": (
            extra_bytes(result, "other (attention path)"),
            config.n_layer * n1_budget(config, batch, seq_len, autocast),
        ),
    }


def n_usage(result: dict, n1: dict, model: GPT, batch: int, lengths: list[int], autocast: bool = True) -> dict:
    """At N > 1, per part: (engine bytes beyond the same step at N = 1, the budget)."""
    config = model.config
    budgets = {part: config.n_layer * b for part, b in kv_budget(config, batch, lengths, autocast).items()}
    budgets["other (model)"] = weight_budget(model, len(lengths)) + PER_STEP_BYTES_PER_TOKEN * batch * sum(lengths)
    return {part: (result["bytes"][part]["engine"] - n1["bytes"][part]["engine"], b) for part, b in budgets.items()}


def _same_matmuls(result: dict, exact: bool) -> list[str]:
    problems = []
    parts = ("matmul", "attention") if exact else ()
    for part in parts:
        if result[part]["extra"] or result[part]["missing"]:
            problems.append(f"{part} ops differ from the plain model's: {_summary(result[part])}")
    if result["bytes"]["matmul_flops"]["engine"] != result["bytes"]["matmul_flops"]["plain"]:
        problems.append(f"matmul FLOPs differ: {result['bytes']['matmul_flops']}")
    return problems


def check_n1(result: dict, config: GPTConfig, batch: int, seq_len: int, autocast: bool = True) -> list[str]:
    """What breaks the N = 1 contract (module docstring); empty when it holds."""
    problems = _same_matmuls(result, exact=True)
    for part, (used, budget) in n1_usage(result, config, batch, seq_len, autocast).items():
        if used > budget:
            problems.append(f"{part}: {used:,} extra bytes > {budget:,}: {_summary(result[part])}")
    return problems


def check_n(result: dict, n1: dict, model: GPT, batch: int, lengths: list[int], autocast: bool = True) -> list[str]:
    """What breaks the N > 1 contract against the same step at N = 1 (``n1``); empty when it holds."""
    problems = _same_matmuls(result, exact=False)
    for part, (used, budget) in n_usage(result, n1, model, batch, lengths, autocast).items():
        if used > budget:
            problems.append(f"{part}: {used:,} bytes more than at N=1 > budget {budget:,}")
    return problems


def _summary(diff: dict) -> str:
    rows = [*(("+", r) for r in diff["extra"]), *(("-", r) for r in diff["missing"])]
    return "; ".join(f"{sign}{r['count']} {r['op']} {_short(r['inputs'])} ({r['bytes']:,} B)" for sign, r in rows[:4])


# -- the script ----------------------------------------------------------------------------------------------


def census(config: GPTConfig, seq_len: int, lengths_of: Iterable[int], seed: int = 0) -> dict:
    """Plain and engine census of one step of a fresh model (the same weights and batch for every run), with the
    budget checks; ``lengths_of``: the N to run ("length" partition)."""
    torch.manual_seed(seed)
    model = GPT(config)
    ids = torch.randint(config.vocab_size, (1, seq_len))
    targets = torch.randint(config.vocab_size, (1, seq_len))
    plain = record(steady(plain_step(model, ids, targets), model))
    results, n1 = {}, None
    for n in sorted(lengths_of):
        engine, engine_model = SubsequenceEngine(n, "length"), copy.deepcopy(model)
        result = compare(plain, record(steady(engine_step(engine_model, ids, targets, engine), engine_model)))
        lengths = list(engine.plan(ids, config).lengths)
        if n == 1:
            n1, result["problems"] = result, check_n1(result, config, 1, seq_len)
            result["budget"] = n1_usage(result, config, 1, seq_len)
        elif n1 is not None:
            result["problems"] = check_n(result, n1, model, 1, lengths)
            result["budget"] = n_usage(result, n1, model, 1, lengths)
        result["lengths"] = lengths
        results[f"N={n}"] = result
    return results


def _table(name: str, result: dict, layers: int) -> str:
    b = result["bytes"]
    lines = [f"## {name}", "", f"matmul FLOPs: plain {b['matmul_flops']['plain']:,}, engine {b['matmul_flops']['engine']:,}",
             "", "| bytes | plain | engine | extra | extra per layer |", "|---|---|---|---|---|"]  # fmt: skip
    for part in ("attention", "other (model)", "other (attention path)"):
        extra = extra_bytes(result, part)
        lines.append(f"| {part} | {b[part]['plain']:,} | {b[part]['engine']:,} | {extra:,} | {extra / layers:,.0f} |")
    against = "the plain model" if result["lengths"] == [sum(result["lengths"])] else "N=1"
    for part, (used, budget) in result.get("budget", {}).items():
        lines.append(f"| {part}: bytes beyond {against} / budget | | | {used:,} / {budget:,} | {used / layers:,.0f} |")
    lines += ["", f"budget problems: {result.get('problems', 'not checked (run N=1 too)')}", "",
              "| part | op | count | bytes | inputs -> outputs |", "|---|---|---|---|---|"]  # fmt: skip
    for part in ("matmul", "attention", "other (model)", "other (attention path)"):
        for side in ("extra", "missing"):
            for row in result[part][side][:12]:
                shapes = f"{_short(row['inputs'])} -> {_short(row['outputs'])}"
                lines.append(f"| {part} {side} | {row['op']} | {row['count']} | {row['bytes']:,} | {shapes} |")
    return "\n".join(lines)


def _short(signature) -> str:
    return ", ".join(f"{dtype}{list(shape)}" for dtype, shape in signature)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--num-subsequences", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/op_census_small_cpu"),
                        help="writes OUT.json (every op row) and OUT.md (the tables)")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = GPTConfig.from_name(args.model)
    results = census(config, args.seq_len, args.num_subsequences)
    tables = []
    for name, result in results.items():
        title = f"{args.model}, {args.seq_len} tokens, engine {name} vs plain (bf16 autocast, CPU, torch {torch.__version__})"
        tables.append(_table(title, result, config.n_layer))
    print("\n\n".join(tables))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"model": args.model, "seq_len": args.seq_len, "torch": torch.__version__, "results": results}
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=list) + "\n")
    command = f"python benchmarks/op_census.py --model {args.model} --seq-len {args.seq_len} --num-subsequences"
    header = f"# Op census: engine vs plain model\n\n`{command} {' '.join(map(str, args.num_subsequences))}`\n\n"
    args.out.with_suffix(".md").write_text(header + "\n\n".join(tables) + "\n")
    print(f"wrote {args.out.with_suffix('.json')} and .md")


if __name__ == "__main__":
    main()
