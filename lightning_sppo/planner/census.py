"""What one layer pass makes the GPU do besides its matmuls and attention kernels, counted from the code.

A training step is more than its matmuls and attention: norms, RoPE, SwiGLU, residual adds, autocast's casts, the
loss's softmax, the engine's K/V copies and dK/dV sums, the weight gradients' casts and sums. Each is an
elementwise kernel whose time is the HBM bytes it reads and writes over the bandwidth such kernels reach, and each
costs the host a dispatch (Python, the dispatcher, a launch). Both are counted here by running the real code (the
model, the engine, the recompute wrappers, the chunked loss) once on CPU on a tiny model with the same structure,
under a ``TorchDispatchMode`` that sees every ATen op with its tensors, per pass: the bytes of every tensor an op
reads or writes, and one op per kernel launched. Nothing is estimated by hand, so the counts follow the code.

Bytes are attributed per tensor to what they scale with, read off its size: per token of the pass, one of the model's
widths (``WIDTHS``: hidden size, MLP width, query, K/V and fused qkv widths, head size, heads, vocabulary); per token
of the K/V prefix the pass reads (the engine's dK/dV sums over earlier subsequences); per block parameter (weight
casts, weight gradients); or a constant. The census model gives every width a distinct size (and its subsequences
lengths that are none of them), so the attribution is unambiguous; a real model's bytes are then the coefficients
times its own widths (``Counts.bytes``). Matmuls and attention kernels are left out of the bytes (``costs`` times
them by their FLOPs) but count as ops.

Passes (``PASSES``), per layer: the engine's forward and backward of a subsequence without and with a prefix of K/V
before it, under each recompute mode ("backward" includes the recomputed forward), and the plain model's (the full
sequence at once, optionally with every block checkpointed: "plain + AC"). Besides, per stage, the head and loss
(``head_forward``, ``head_backward``) and what the step does once (``step``: the K/V gradient buffers zeroed).
Precision modes: ``"autocast"`` (bf16-mixed on one unsharded rank: fp32 parameters and residual, bf16 matmuls),
``"bf16"`` (FSDP2's bf16 mixed precision: parameters, activations and residual in bf16) and ``"fp32"``.

This runs torch code, so it is imported lazily and cached per structure (``census``); one census takes about a second.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

__all__ = [
    "PASSES",
    "PRECISIONS",
    "WIDTHS",
    "Counts",
    "PassCounts",
    "census",
    "run_census",
    "structure_of",
    "widths_of",
]

WIDTHS = ("embd", "mlp", "q", "kv", "qkv", "head", "heads", "vocab", "one", "half", "q_half", "kv_half")
"""Per-token widths bytes scale with: n_embd, intermediate_size, H Dh, G Dh, (H + 2G) Dh, Dh, H, vocab_size, 1 (a
norm's statistics), Dh / 2, H Dh / 2 and G Dh / 2 (RoPE's halves)."""
PRECISIONS = ("autocast", "bf16", "fp32")
"""How the census runs the model: bf16-mixed unsharded (autocast), sharded (FSDP2's bf16 parameters), fp32."""
PASSES = ("forward", "forward_prefix", "backward", "backward_prefix")
"""Engine passes of one layer: a subsequence without a K/V prefix (the first) and with one (the others)."""

# The census model: every width distinct, subsequence lengths none of them (nor a multiple that could collide).
_H, _G, _DH = 9, 3, 8
_EMBD, _MLP, _VOCAB = 56, 80, 104
_LENGTHS = (40, 24, 32)
"""The engine's three subsequences: the second (24 tokens after a prefix of 40) gives the prefix coefficients."""
_CHUNK_TOKENS = 8
"""The census loss's chunk (so that ops per chunk are seen); real runs use ``loss.default_chunk_tokens``."""
_CHUNKED = frozenset({"vocab", "embd", "one"})
"""Widths a loss chunk's tensors have ([chunk, V] logits, [chunk, D] hidden, [chunk] statistics)."""
_VIEWS = frozenset(
    [
        "view",
        "_unsafe_view",
        "t",
        "transpose",
        "permute",
        "expand",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "as_strided",
        "alias",
        "detach",
        "split",
        "split_with_sizes",
        "unbind",
        "_reshape_alias",
        "reshape",
        "narrow",
        "lift_fresh",
        "unflatten",
        "chunk",
        "expand_as",
        "_local_scalar_dense",
        "sym_size",
        "is_same_size",
        "promote_types",
        "result_type",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "set_",
        "_has_compatible_shallow_copy_type",
        "view_as_real",
        "view_as_complex",
    ]
)
"""Ops that launch no kernel (views, metadata, uninitialised allocations)."""
_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
_WRITE_ONLY = frozenset({"zero_", "fill_", "copy_", "normal_", "uniform_"})
"""In-place ops that overwrite their first argument without reading it: it is counted once, as written."""
_GATHERS = frozenset({"embedding", "nll_loss_forward", "nll_loss2d_forward", "index_select", "gather"})
"""Ops that read a few rows of their first argument (a table, the log-probabilities): it is not counted."""
_ATTENTION_PREFIXES = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")


@dataclass(frozen=True)
class PassCounts:
    """HBM bytes and ops of one layer pass (or of the head and loss), by what they scale with."""

    per_token: dict[str, float] = field(default_factory=dict)
    """Width -> bytes per token of the pass per unit of that width."""
    per_prefix: dict[str, float] = field(default_factory=dict)
    """Width -> bytes per token of K/V prefix per unit of that width."""
    per_param: float = 0.0
    """Bytes per parameter of the block (weight casts, weight-gradient casts and sums)."""
    constant: float = 0.0
    """Bytes that scale with nothing (scalars, masks)."""
    per_root_param: float = 0.0
    """Bytes per parameter outside the blocks once per pass (head and loss only: the embedding's gradient, the head's
    cast for the forward's chunks, which autocast caches)."""
    per_token_chunk: dict[str, float] = field(default_factory=dict)
    """Width -> bytes per token per loss chunk per unit of that width (head and loss only: autograd gives each
    chunk's slice of the hidden states a gradient the size of all of them, and sums those)."""
    ops_per_chunk: float = 0.0
    """Ops per loss chunk (head and loss only)."""
    saved: float = 0.0
    """Tensors autograd saves for backward per forward pass (what the offloader's hooks pack and unpack)."""
    saved_storages: float = 0.0
    """Distinct activation storages among them, weights and their casts left out (the offloader copies one unit per
    storage)."""
    ops: float = 0.0
    """Ops dispatched (kernels launched) per pass."""

    def bytes(
        self, widths: dict[str, int], tokens: float, prefix: float = 0.0, params: float = 0.0, chunks: float = 0.0,
        root_params: float = 0.0,
    ) -> float:  # fmt: skip
        """Bytes of this pass for a model of ``widths``: ``tokens`` tokens after ``prefix``, ``params`` parameters per
        block (for the head and loss: its parameters per chunk), ``chunks`` loss chunks, ``root_params`` parameters
        outside the blocks (once per pass)."""
        total = tokens * sum(c * widths[w] for w, c in self.per_token.items())
        total += tokens * chunks * sum(c * widths[w] for w, c in self.per_token_chunk.items())
        total += prefix * sum(c * widths[w] for w, c in self.per_prefix.items())
        return total + params * self.per_param + root_params * self.per_root_param + self.constant

    def op_count(self, chunks: float = 0.0) -> float:
        """Ops of this pass (with ``chunks`` loss chunks for the head and loss)."""
        return self.ops + chunks * self.ops_per_chunk


@dataclass(frozen=True)
class Counts:
    """The census of one structure and precision mode."""

    engine: dict[str, dict[str, PassCounts]]
    """Recompute mode -> ``PASSES`` -> per-layer counts of the engine."""
    plain: dict[str, PassCounts]
    """"forward", "backward", "ac_forward", "ac_backward": per-layer counts of the plain model (all tokens at once)."""
    head_forward: PassCounts
    """The embedding, final norm, head and chunked loss of one pass (per token; ops per loss chunk)."""
    head_backward: PassCounts
    step: PassCounts
    """Once per step: the K/V gradient buffers zeroed (per token of the sequence)."""
    chunk_tokens: int
    """Tokens per loss chunk in the census (head ops are per chunk)."""
    plain_saved: PassCounts = field(default_factory=PassCounts)
    """What the plain model saves for backward per layer (``per_token``: unique storages autograd keeps, by width;
    ``per_param``: the autocast copies of the weights), measured with ``saved_tensors_hooks``."""


def structure_of(config: Any) -> tuple:
    """What of a ``GPTConfig`` changes which ops run (not their sizes): the census is cached on it."""
    return (
        config.mlp, config.norm, config.bias, config.attn_bias, config.norm_qk, config.tie_embeddings,
        config.rotary_percentage == 1.0, config.n_query_groups == config.n_head,
    )  # fmt: skip


@functools.lru_cache(maxsize=16)
def census(structure: tuple, precision: str) -> Counts:
    """The counts of ``structure`` (``structure_of``) under ``precision`` ("autocast", "bf16", "fp32"): from the table
    ``census_table`` (every registered model's structure, written by ``python -m lightning_sppo.planner.census``, and
    checked against the code by ``tests/planner/test_census.py``), else counted now (seconds; cached)."""
    from lightning_sppo.planner.census_table import TABLE

    key = _key(structure, precision)
    return counts_from_dict(TABLE[key]) if key in TABLE else run_census(structure, precision)


def run_census(structure: tuple, precision: str) -> Counts:
    """Count every pass of a tiny model of ``structure`` under ``precision`` by running it (module docstring)."""
    import torch

    # The census trains a tiny model: gradients on whatever mode its caller is in (the first step planned under
    # num_subsequences="auto" can be an evaluation under inference_mode, as Lightning's sanity check runs it).
    with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad():
        torch.manual_seed(0)
        engine = {mode: _engine_passes(structure, precision, mode) for mode in ("none", "selective", "full")}
        plain, head_forward, head_backward = _plain_passes(structure, precision)
    step = engine["none"].pop("step")
    for passes in engine.values():
        passes.pop("step", None)
    saved = plain.pop("saved")
    return Counts(engine, plain, head_forward, head_backward, step, _CHUNK_TOKENS, saved)


def _key(structure: tuple, precision: str) -> str:
    return f"{precision}:" + ",".join(str(part) for part in structure)


def counts_to_dict(counts: Counts) -> dict:
    return asdict(counts)


def counts_from_dict(data: dict) -> Counts:
    def one(value: dict) -> PassCounts:
        return PassCounts(**value)

    return Counts(
        engine={mode: {name: one(v) for name, v in passes.items()} for mode, passes in data["engine"].items()},
        plain={name: one(v) for name, v in data["plain"].items()}, head_forward=one(data["head_forward"]),
        head_backward=one(data["head_backward"]), step=one(data["step"]), chunk_tokens=data["chunk_tokens"],
        plain_saved=one(data.get("plain_saved", {})),
    )  # fmt: skip


# -- running the code --------------------------------------------------------------------------------------


def _config(structure: tuple, layers: int):
    from lightning_sppo.model.config import GPTConfig

    mlp, norm, bias, attn_bias, norm_qk, tie, full_rope, mha = structure
    return GPTConfig(
        name="census", block_size=1024, vocab_size=_VOCAB, n_layer=layers, n_embd=_EMBD, n_head=_H,
        n_query_groups=_H if mha else _G, head_size=_DH, intermediate_size=_MLP, mlp=mlp, norm=norm, bias=bias,
        attn_bias=attn_bias, norm_qk=norm_qk, tie_embeddings=tie, rotary_percentage=1.0 if full_rope else 0.5,
    )  # fmt: skip


def widths_of(config) -> dict[str, int]:
    """A ``GPTConfig``'s widths (``WIDTHS``)."""
    h, g, dh = config.n_head, config.n_query_groups, config.head_size
    return {
        "embd": config.n_embd, "mlp": config.intermediate_size, "q": h * dh, "kv": g * dh,
        "qkv": (h + 2 * g) * dh, "head": dh, "heads": h, "vocab": config.vocab_size, "one": 1, "half": dh // 2,
        "q_half": h * dh // 2, "kv_half": g * dh // 2,
    }  # fmt: skip


def _model(structure: tuple, precision: str, layers: int):
    import torch

    from lightning_sppo.model.gpt import GPT

    model = GPT(_config(structure, layers))
    return model.to(torch.bfloat16) if precision == "bf16" else model


def _context(precision: str) -> Callable:
    import torch

    if precision == "autocast":
        return lambda: torch.autocast("cpu", torch.bfloat16)
    from contextlib import nullcontext

    return nullcontext


class _Census:
    """Records, per phase, every op's tensors by class (see the module docstring)."""

    def __init__(self, model, tokens_of: Callable[[Any], tuple[int, int]], chunk: int) -> None:
        self.phase: Any = "step"
        self.tokens_of = tokens_of
        self.bytes: dict[Any, Counter] = {}
        self.ops: Counter = Counter()
        self.params = {tuple(sorted(p.shape)) for p in model.parameters() if p.dim() == 2}
        self.param_sizes = {p.numel() for p in model.parameters() if p.dim() == 1}
        self.widths = widths_of(model.config)
        self.chunk = chunk
        self.other: Counter = Counter()
        self.saves: Counter = Counter()
        self.storages: Counter = Counter()

    def record(self, name: str, tensors: list) -> None:
        if name in _VIEWS:
            return
        self.ops[self.phase] += 1
        if name in _MATMULS or name.startswith(_ATTENTION_PREFIXES):
            return
        counter = self.bytes.setdefault(self.phase, Counter())
        tokens, prefix = self.tokens_of(self.phase)
        for t in tensors:
            kind = self._classify(t, tokens, prefix)
            if kind == "param" and name.startswith("embedding"):
                kind = "embedding"  # the embedding's gradient: once per backward, not per loss chunk
            counter[kind] += t.numel() * t.element_size()

    def _classify(self, t, tokens: int, prefix: int) -> str:
        numel = t.numel()
        if tuple(sorted(t.shape)) in self.params or (t.dim() == 1 and numel in self.param_sizes):
            return "param"
        # A loss chunk's tensors hold ``chunk`` tokens (the census's lengths are whole chunks): per token the same.
        for key, divisor, names in (
            ("token", tokens, WIDTHS),
            ("token", self.chunk, _CHUNKED),
            ("prefix", prefix, WIDTHS),
        ):
            if divisor and numel % divisor == 0:
                width = numel // divisor
                for name in names:
                    if width == self.widths[name]:
                        return f"{key}:{name}"
        if numel <= 4:
            return "constant"
        self.other[tuple(t.shape)] += 1
        return "other"


@contextmanager
def _recording(census: _Census) -> Iterator[None]:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            read = args[1:] if name in _WRITE_ONLY or name in _GATHERS else args
            tensors = [x for x in _flatten([read, kwargs or {}, out]) if isinstance(x, torch.Tensor)]
            census.record(name, tensors)
            return out

    with Mode():
        yield


def _flatten(value) -> Iterator:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flatten(item)
    else:
        yield value


def _engine_run(structure: tuple, precision: str, recompute: str, layers: int) -> tuple[_Census, Any]:
    """One engine step of ``_LENGTHS`` on a model of ``layers`` blocks, recorded by phase."""
    import torch

    from lightning_sppo.recompute import apply_recompute
    from lightning_sppo.runtime.engine import SubsequenceEngine
    from lightning_sppo.step_plan import StepPlan

    model = apply_recompute(_model(structure, precision, layers), recompute)
    seq_len = sum(_LENGTHS)
    ids = torch.randint(0, _VOCAB, (1, seq_len))
    targets = torch.randint(0, _VOCAB, (1, seq_len))
    engine = SubsequenceEngine(len(_LENGTHS), "length", attention="auto", loss_chunk_tokens=_CHUNK_TOKENS)
    offsets = [sum(_LENGTHS[:i]) for i in range(len(_LENGTHS))]

    def tokens_of(phase) -> tuple[int, int]:
        if phase == "step":
            return seq_len, 0
        return _LENGTHS[phase[1]], offsets[phase[1]]

    census = _Census(model, tokens_of, _CHUNK_TOKENS)
    forward, backward = engine.forward, engine.backward

    def phased_forward(state, index):
        census.phase = ("forward", index)
        try:
            with _counting_saves(census, ("forward", index)):
                return forward(state, index)
        finally:
            census.phase = "step"

    def phased_backward(state, index, fn=None):
        census.phase = ("backward", index)
        try:
            return backward(state, index, fn)
        finally:
            census.phase = "step"

    engine.forward, engine.backward = phased_forward, phased_backward
    plan = StepPlan(_LENGTHS)  # uneven on purpose: each phase's tokens are known
    step = lambda: engine.forward_backward(model, ids, targets, plan=plan, forward_context=_context(precision))  # noqa: E731
    step()  # warm: buffers allocated, autocast's first casts
    model.zero_grad(set_to_none=True)
    with _recording(census):
        step()
    return census, model


def _engine_passes(structure: tuple, precision: str, recompute: str) -> dict[str, PassCounts]:
    """Per-layer counts (two layers minus one) of the engine's passes under ``recompute``."""
    one, model = _engine_run(structure, precision, recompute, 1)
    two, _ = _engine_run(structure, precision, recompute, 2)
    widths = widths_of(model.config)
    params = _block_params(model)
    out = {}
    for name, (kind, index) in {
        "forward": ("forward", 0), "forward_prefix": ("forward", 1),
        "backward": ("backward", 0), "backward_prefix": ("backward", 1),
    }.items():  # fmt: skip
        out[name] = _difference(two, one, (kind, index), widths, _LENGTHS[index], _LENGTHS[0] * (index > 0), params)
    out["step"] = _difference(two, one, "step", widths, sum(_LENGTHS), 0, params)
    return out


def _plain_passes(structure: tuple, precision: str) -> tuple[dict[str, PassCounts], PassCounts, PassCounts]:
    """Per-layer counts of the plain model (with and without every block checkpointed), and the head and loss."""
    runs = {}
    for ac in (False, True):
        for layers in (1, 2):
            runs[ac, layers] = _plain_run(structure, precision, layers, ac, _CHUNK_TOKENS)
    coarse = _plain_run(structure, precision, 1, False, 2 * _CHUNK_TOKENS)[0]
    tokens = sum(_LENGTHS)
    model = runs[False, 1][1]
    widths, params = widths_of(model.config), _block_params(model)
    plain = {}
    for ac in (False, True):
        for kind in ("forward", "backward"):
            key = f"ac_{kind}" if ac else kind
            plain[key] = _difference(runs[ac, 2][0], runs[ac, 1][0], kind, widths, tokens, 0, params)
    plain["saved"] = _difference(runs[False, 2][0], runs[False, 1][0], "saved", widths, tokens, 0, params)
    head_params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    head = {
        kind: _head((runs[False, 1][0], coarse), plain[kind], kind, widths, tokens, params, head_params)
        for kind in ("forward", "backward")
    }
    return plain, head["forward"], head["backward"]


def _plain_run(structure: tuple, precision: str, layers: int, ac: bool, chunk: int) -> tuple[_Census, Any]:
    import torch
    from torch.utils.checkpoint import checkpoint

    from lightning_sppo.loss import chunked_cross_entropy

    model = _model(structure, precision, layers)
    if ac:
        for block in model.blocks.values():
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    seq_len = sum(_LENGTHS)
    ids = torch.randint(0, _VOCAB, (1, seq_len))
    targets = torch.randint(0, _VOCAB, (1, seq_len))
    census = _Census(model, lambda phase: (seq_len, 0), chunk)

    def step(record: bool) -> None:
        model.zero_grad(set_to_none=True)
        census.phase = "forward"
        saving = _saving(census, model) if record and not ac else _nothing()
        with _recording(census) if record else _nothing(), _context(precision)(), saving:
            loss = chunked_cross_entropy(model.hidden_states(ids), model.lm_head.weight, targets, seq_len, chunk)
        census.phase = "backward"
        with _recording(census) if record else _nothing():
            loss.backward()

    step(False)
    step(True)
    return census, model


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextmanager
def _counting_saves(census: _Census, phase) -> Iterator[None]:
    """Count the tensors saved in ``phase`` (every pack) and their distinct storages, as the offloader would see them
    (its hooks wrap each subsequence's forward the same way)."""
    import torch

    storages: set[int] = set()

    def pack(t):
        census.saves[phase] += 1
        if census._classify(t, *census.tokens_of(phase)) not in ("param", "constant"):  # weights and their casts stay
            storages.add(t.untyped_storage().data_ptr())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        census.storages[phase] += len(storages)


@contextmanager
def _saving(census: _Census, model) -> Iterator[None]:
    """Count every storage autograd saves (once), by class, into the census's "saved" phase."""
    import torch

    seen: set[int] = set()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    counter = census.bytes.setdefault("saved", Counter())
    tokens, _ = census.tokens_of("saved")

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in seen and key not in params and storage.nbytes():
            seen.add(key)
            whole = (
                t
                if t.numel() * t.element_size() == storage.nbytes()
                else t.new_empty(storage.nbytes() // t.element_size())
            )
            counter[census._classify(whole, tokens, 0)] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _block_params(model) -> int:
    return sum(p.numel() for p in model.blocks["0"].parameters())


def _difference(
    two: _Census, one: _Census, phase, widths: dict[str, int], tokens: int, prefix: int, params: int
) -> PassCounts:
    """The counts of one layer: the phase's bytes and ops with two layers minus those with one."""
    a, b = two.bytes.get(phase, Counter()), one.bytes.get(phase, Counter())
    counts = _counts({k: a[k] - b[k] for k in set(a) | set(b)}, two.ops[phase] - one.ops[phase], widths, tokens,
                     prefix, params)  # fmt: skip
    saves = float(two.saves[phase] - one.saves[phase])
    return replace(counts, saved=saves, saved_storages=float(two.storages[phase] - one.storages[phase]))


def _head(
    runs: tuple[_Census, _Census],
    layer: PassCounts,
    phase: str,
    widths: dict[str, int],
    tokens: int,
    params: int,
    head_params: int,
) -> PassCounts:
    """What one pass does outside the blocks: a one-layer run minus one layer's counts, at the census's chunk and at
    twice it, which tells what grows with the number of chunks (``PassCounts.per_token_chunk``, ``ops_per_chunk``)
    from what does not. ``per_param`` is per parameter outside the blocks (embedding, final norm, head) per chunk
    (the recomputed chunks cast the head's weight again each), ``per_root_param`` per such parameter once per pass."""
    heads = []
    for census, chunk in zip(runs, (_CHUNK_TOKENS, 2 * _CHUNK_TOKENS), strict=True):
        raw = dict(census.bytes.get(phase, Counter()))
        embedding = raw.pop("embedding", 0)  # the embedding's gradient: once per pass
        counts = _counts(raw, census.ops[phase], widths, tokens, 0, 0)
        per_token = {w: counts.per_token.get(w, 0.0) - layer.per_token.get(w, 0.0) for w in WIDTHS}
        params_bytes = counts.per_param - layer.per_param * params
        heads.append((tokens // chunk, per_token, params_bytes + embedding, counts.ops - layer.ops, counts.constant))
    (fine, a, p_a, o_a, constant), (coarse, b, p_b, o_b, _) = heads
    per_chunk = {w: (a[w] - b[w]) / (fine - coarse) for w in WIDTHS}
    param_chunk = (p_a - p_b) / (fine - coarse)
    return PassCounts(
        per_token={w: c for w in WIDTHS if abs(c := a[w] - fine * per_chunk[w]) > 1e-9},
        per_token_chunk={w: c for w, c in per_chunk.items() if abs(c) > 1e-9},
        per_param=param_chunk / head_params, constant=constant - layer.constant,
        ops=o_a - fine * (o_a - o_b) / (fine - coarse), ops_per_chunk=(o_a - o_b) / (fine - coarse),
        per_root_param=(p_a - fine * param_chunk) / head_params,
    )  # fmt: skip


def _counts(
    raw: dict[str, float], ops: float, widths: dict[str, int], tokens: int, prefix: int, params: int
) -> PassCounts:
    per_token, per_prefix, per_param, constant = {}, {}, 0.0, 0.0
    for key, nbytes in raw.items():
        if not nbytes:
            continue
        if key.startswith("token:"):
            width = key.split(":")[1]
            per_token[width] = nbytes / (tokens * widths[width])
        elif key.startswith("prefix:"):
            width = key.split(":")[1]
            per_prefix[width] = nbytes / (prefix * widths[width])
        elif key == "param":
            per_param = nbytes / params if params else nbytes
        else:  # constants and anything unclassified (tests check there is none of the latter)
            constant += nbytes
    return PassCounts(
        per_token=per_token, per_prefix=per_prefix, per_param=per_param, constant=constant, ops=float(ops)
    )


def write_table(path: str) -> None:
    """Count every registered model's structure under every precision and write ``census_table`` to ``path``."""
    from lightning_sppo.model.config import GPTConfig

    structures = sorted({structure_of(GPTConfig.from_name(name)) for name in GPTConfig.available()}, key=repr)
    table = {}
    for structure in structures:
        for precision in PRECISIONS:
            table[_key(structure, precision)] = counts_to_dict(run_census(structure, precision))
            print(f"counted {_key(structure, precision)}", flush=True)
    write_table_text(table, path)


def write_table_text(table: dict, path: str) -> None:
    """``census_table``'s text: one line per structure and precision, its counts as JSON."""
    import json

    rows = "\n".join(
        f"{key} {json.dumps(value, sort_keys=True, separators=(',', ':'))}" for key, value in table.items()
    )
    text = (
        '"""The census (``planner.census``) of every registered model\'s structure under every precision, as counted by\n'
        "``python -m lightning_sppo.planner.census``; ``tests/planner/test_census.py`` checks it against the code.\n"
        '"""\n\nimport json\n\n_ROWS = """\n' + rows + '\n"""\nTABLE = {key: json.loads(value) for key, value in'
        ' (line.split(" ", 1) for line in _ROWS.strip().splitlines())}\n'
    )
    with open(path, "w") as out:
        out.write(text)


if __name__ == "__main__":
    import sys

    write_table(sys.argv[1] if len(sys.argv) > 1 else __file__.replace("census.py", "census_table.py"))
