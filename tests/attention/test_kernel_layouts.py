"""One layout per tensor role at every attention kernel call, whatever path made the inputs (``attention.layouts``).

A recording backend stands behind the kernel boundary, where an ATen op stands: per call and role (q, k, v, out,
dout, lse) it records the order of the dimensions in memory (``memory_order``; sizes differ between chunks, size-1
dimensions have no place), then computes with the backend it wraps (the CPU flash op, or the reference kernel). Every
path of both orders runs through it (offload none/adaptive/full, recompute none/selective/full, K/V streamed from
host, chunk views, packed documents, MHA/GQA/MQA, one row and two) and must give the plain model's loss and
gradients; per role, every call must follow the role's canonical layout, across layers and chunks.

Negative controls: without the choke point (``layouts.canonical`` the identity) the K/V streamed from host reach the
kernel in two layouts in both orders; with cc41023's host round trip as well (checkpoints copied contiguous), the
layer order's out, dout and lse do (``../shared/reviews/gpu-readiness.md`` section 1), and the choke point alone puts
them back in one.
"""

from __future__ import annotations

import copy
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from lightning_sppo import GPT
from lightning_sppo.attention import ReferenceKernel, SDPAKernel, apply_subsequence_attention, layouts
from lightning_sppo.attention.layouts import BHS, BSH, BSHD, KernelBoundary, RoleLayouts, memory_order
from lightning_sppo.offload import OffloadCosts, build_offloader
from lightning_sppo.recompute import apply_recompute
from lightning_sppo.runtime import LayerMajorEngine, SubsequenceEngine
from lightning_sppo.runtime.layer_major import _Checkpoints
from tests.conftest import IGNORE, document_ids_from_lengths, make_batch, max_relative_error, parity_config

S = 45  # cut into 3 chunks of 15; streamed K/V chunks of 7 straddle them
ROLES = ("q", "k", "v", "out", "dout", "lse")
NAMES = {"lse": "BHS"}  # every other role: [B, heads, S, Dh]

pytestmark = pytest.mark.usefixtures("one_thread")


class RecordingKernel(KernelBoundary):
    """A backend that records what reaches it, behind the boundary as an op would see it, then lets ``inner``
    compute (its ``forward``/``backward``: the tensors are canonical already, so its own boundary copies nothing)."""

    def __init__(self, inner: KernelBoundary) -> None:
        self.inner = inner
        self.name = f"recording {inner.name}"
        self.orders: dict[str, Counter[str]] = defaultdict(Counter)
        self.roles: RoleLayouts | None = None

    def layouts(self, q):
        self.roles = self.inner.layouts(q)
        return self.roles

    def _forward(self, q, k, v, causal, scale, pieces):
        self._record(q=q, k=k, v=v)
        return self.inner.forward(q, k, v, causal, scale, pieces=pieces)

    def _backward(self, dout, q, k, v, out, lse, causal, scale, pieces):
        self._record(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
        return self.inner.backward(dout, q, k, v, out, lse, causal, scale, pieces=pieces)

    def _record(self, **tensors) -> None:
        for role, x in tensors.items():
            self.orders[role][memory_order(x, NAMES.get(role, "BHSD"))] += 1


def conflicts(orders: Counter[str]) -> list[str]:
    """Pairs of dimensions that some calls lay out one way round and others the other (empty: one layout)."""
    before = {(a, b) for order in orders for i, a in enumerate(order) for b in order[i + 1 :]}
    return sorted(f"{a}/{b}" for a, b in before if (b, a) in before and a < b)


def off_layout(orders: Counter[str], layout: layouts.Layout) -> list[str]:
    """The recorded orders that do not follow ``layout`` (its dimensions in another order)."""
    return [order for order in orders if not _subsequence(order, layout.name)]


def _subsequence(order: str, of: str) -> bool:
    rest = iter(of)
    return all(name in rest for name in order)


# -- the paths ------------------------------------------------------------------------------------------------------


def _costs(model: GPT, ids, targets) -> OffloadCosts:
    """Costs under which adaptive offload sends about 60% of a subsequence's activations (a measured full run)."""
    full = build_offloader("full", "cpu", min_bytes=0)
    SubsequenceEngine(3, hooks=full).forward_backward(copy.deepcopy(model), ids, targets)
    stats = full.last_stats.subsequences
    return OffloadCosts(d2h_bytes_per_s=1.0, forward_s=(0.6 * sum(s.level2_bytes for s in stats) / len(stats),))


@dataclass(frozen=True)
class Path:
    """How one step is run: the order and its settings."""

    order: str  # "sub" or "layer"
    chunks: int = 3
    offload: str = "none"  # sub: none/adaptive/full; layer: none/full
    recompute: str = "none"  # sub: none/selective/full; layer: selective/full
    spill: bool = False
    documents: bool = False

    def engine(self, model: GPT, ids, targets) -> SubsequenceEngine | LayerMajorEngine:
        spill = dict(kv_device_tokens=10, kv_chunk_tokens=7) if self.spill else {}
        if self.order == "layer":
            return LayerMajorEngine(self.chunks, recompute=self.recompute, offload=self.offload, **spill)
        if self.recompute != "none":
            apply_recompute(model, self.recompute)
        options = dict(min_bytes=0) | (dict(costs=_costs(model, ids, targets)) if self.offload == "adaptive" else {})
        return SubsequenceEngine(self.chunks, hooks=build_offloader(self.offload, "cpu", **options), **spill)


PATHS = {
    "sub-n1": Path("sub", chunks=1),
    "sub": Path("sub"),
    "sub-offload-full": Path("sub", offload="full"),
    "sub-offload-adaptive": Path("sub", offload="adaptive"),
    "sub-recompute-selective": Path("sub", recompute="selective"),
    "sub-recompute-full": Path("sub", recompute="full"),
    "sub-selective-offload-full": Path("sub", recompute="selective", offload="full"),
    "sub-full-offload-adaptive": Path("sub", recompute="full", offload="adaptive"),
    "sub-spill": Path("sub", spill=True),
    "sub-documents": Path("sub", documents=True),
    "sub-documents-spill-offload": Path("sub", documents=True, spill=True, offload="full"),
    "layer-n1": Path("layer", chunks=1, recompute="selective"),
    "layer-selective": Path("layer", recompute="selective"),
    "layer-full": Path("layer", recompute="full"),
    "layer-selective-offload": Path("layer", recompute="selective", offload="full"),
    "layer-full-offload": Path("layer", recompute="full", offload="full"),
    "layer-selective-spill": Path("layer", recompute="selective", spill=True),
    "layer-selective-offload-spill": Path("layer", recompute="selective", offload="full", spill=True),
    "layer-selective-documents": Path("layer", recompute="selective", documents=True),
    "layer-full-documents-spill-offload": Path("layer", recompute="full", documents=True, spill=True, offload="full"),
}
GROUPS = {"mha": 4, "gqa": 2, "mqa": 1}
INNER: dict[str, Callable[[], KernelBoundary]] = {"sdpa": SDPAKernel, "reference": ReferenceKernel}


def run(path: Path, groups: int = 2, rows: int = 2, inner: str = "sdpa") -> RecordingKernel:
    """One step of ``path`` through a recording kernel; checks the loss and every gradient against the plain model."""
    config = parity_config(n_layer=3, n_query_groups=groups)
    torch.manual_seed(0)
    model = GPT(config)
    ids, targets = make_batch(config, rows, S)
    document_ids = document_ids_from_lengths([[12, 20, 13], [30, 15]][:rows]) if path.documents else None
    ref = copy.deepcopy(model)
    loss_ref = F.cross_entropy(
        ref(ids, document_ids=document_ids).flatten(0, 1), targets.flatten(), ignore_index=IGNORE
    )
    loss_ref.backward()
    kernel = RecordingKernel(INNER[inner]())
    apply_subsequence_attention(model, kernel)
    engine = path.engine(model, ids, targets)
    loss = engine.forward_backward(model, ids, targets, document_ids)
    assert abs(loss.item() - loss_ref.item()) / loss_ref.item() < 1e-5
    err, where = max_relative_error({name: p.grad for name, p in ref.named_parameters()}, model)
    assert err < 1e-5, f"{where}: {err}"
    _assert_it_ran(path, engine)
    return kernel


def _assert_it_ran(path: Path, engine: SubsequenceEngine | LayerMajorEngine) -> None:
    """The path really took its detours: activations and K/V went to host memory and came back."""
    if path.spill:
        assert engine.cache_host_nbytes() > 0
    if path.offload != "none" and path.order == "layer":
        assert engine.kept_host_nbytes() > 0
    if path.offload != "none" and path.order == "sub":
        stats = engine.hooks.last_stats
        assert stats.offloaded_bytes > 0 and (path.chunks == 1 or stats.prefetched_bytes > 0)
        assert (stats.offloaded_bytes < stats.level2_bytes) == (path.offload == "adaptive")


def assert_one_canonical_layout(kernel: RecordingKernel) -> None:
    assert set(kernel.orders) == set(ROLES)
    for role in ROLES:
        orders = kernel.orders[role]
        assert not conflicts(orders), f"{role} reached the kernel in more than one layout: {dict(orders)}"
        assert not off_layout(orders, getattr(kernel.roles, role)), f"{role}: {dict(orders)}"


@pytest.mark.parametrize("path", list(PATHS), ids=list(PATHS))
def test_every_path_sends_each_role_in_one_layout(path):
    assert_one_canonical_layout(run(PATHS[path]))


@pytest.mark.parametrize("inner", list(INNER))
@pytest.mark.parametrize("groups", list(GROUPS), ids=list(GROUPS))
@pytest.mark.parametrize("path", ["sub-selective-offload-full", "layer-selective-offload-spill"])
def test_every_head_layout_and_backend_too(path, groups, inner):
    kernel = run(PATHS[path], GROUPS[groups], inner=inner)
    assert_one_canonical_layout(kernel)
    assert kernel.roles.lse == (BSH if inner == "sdpa" else BHS)  # the CPU op's own, the reference's dense


@pytest.mark.parametrize("path", ["sub-offload-full", "layer-selective-offload-spill"])
def test_one_row_too(path):
    assert_one_canonical_layout(run(PATHS[path], rows=1))


# -- negative controls ----------------------------------------------------------------------------------------------


def _no_choke_point(monkeypatch) -> None:
    monkeypatch.setattr(layouts, "canonical", lambda x, layout, dense=False: x)


@pytest.mark.parametrize("path", ["sub-spill", "layer-selective-spill"])
def test_negative_control_without_the_choke_point_streamed_kv_reach_the_kernel_in_two_layouts(monkeypatch, path):
    """Host chunks of two rows come back token-major ([n, B, G, Dh], viewed as [B, G, n, Dh]): S outside B."""
    _no_choke_point(monkeypatch)
    kernel = run(PATHS[path])
    for role in ("k", "v"):
        assert conflicts(kernel.orders[role]) == ["B/S"], dict(kernel.orders[role])


def _round_trip_of_cc41023(monkeypatch) -> None:
    """``_Checkpoints.put`` as it was: what goes to host is copied contiguous, the last layer's kept as it is."""
    put = _Checkpoints.put

    def contiguous_put(self, layer, chunk, tensors):
        if self._host and layer != self._layers - 1:
            tensors = tuple(t.contiguous() for t in tensors)
        put(self, layer, chunk, tensors)

    monkeypatch.setattr(_Checkpoints, "put", contiguous_put)


def test_negative_control_the_host_round_trip_of_cc41023_sends_out_dout_lse_in_two_layouts(monkeypatch):
    _round_trip_of_cc41023(monkeypatch)
    with monkeypatch.context() as inner:
        _no_choke_point(inner)
        kernel = run(PATHS["layer-selective-offload"])
        assert {role for role in ROLES if conflicts(kernel.orders[role])} == {"out", "dout", "lse"}
        assert conflicts(kernel.orders["out"]) == ["H/S"]  # BHSD from host, BSHD in the last layer
    assert_one_canonical_layout(run(PATHS["layer-selective-offload"]))  # the choke point alone puts them in one


def test_a_host_round_trip_restores_strides():
    """What the layer order keeps goes to host and back with its strides: the out of a kernel (BSHD), the CPU op's
    log-sum-exp (BSH), a view with gaps (q of the fused projection)."""
    qkv = torch.randn(2, 9, 8 * 4)
    tensors = (
        torch.randn(2, 9, 4, 4).transpose(1, 2),
        torch.randn(2, 9, 4).transpose(1, 2),
        qkv.view(2, 9, 8, 4)[:, :, :4].transpose(1, 2),
    )
    checkpoints = _Checkpoints(torch.device("cpu"))
    checkpoints.begin(2, host=True)
    checkpoints.put(0, 0, tensors)
    checkpoints.prefetch(0)
    back = checkpoints.get(0, 0)
    assert checkpoints.host_nbytes() >= sum(t.nbytes for t in tensors)
    for got, sent in zip(back, tensors, strict=True):
        assert got.stride() == sent.stride() and torch.equal(got, sent)
        assert got.untyped_storage().data_ptr() != sent.untyped_storage().data_ptr()  # it did make the trip


# -- the boundary's own checks --------------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", list(INNER))
def test_a_rectangular_causal_call_is_refused_by_every_backend(inner):
    """ATen's kernels and the reference align a causal mask top-left: 4 queries over 9 keys would see the first 4
    keys as their own, not the last 4."""
    kernel = INNER[inner]()
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 9, 8)
    with pytest.raises(ValueError, match=r"square causal attention only.*got 4 queries over 9 keys.*causal=False"):
        kernel.forward(q, k, k, True, 0.3)
    out, lse = kernel.forward(q, k, k, False, 0.3)  # the same shapes as a prefix call run
    with pytest.raises(ValueError, match="square causal attention only"):
        kernel.backward(out, q, k, k, out, lse, True, 0.3)


def test_canonical_is_the_tensor_itself_when_it_follows_the_layout():
    """No copy on the common path: the projections' q (a view with gaps), the cache's prefix, a chunk's rows."""
    qkv = torch.randn(2, 9, 8 * 4)
    q = qkv.view(2, 9, 8, 4)[:, :, :4].transpose(1, 2)
    cache = torch.empty(2, 20, 2, 4).transpose(1, 2)
    for x in (q, cache[:, :, :7], cache[1:, :, 3:5], torch.randn(2, 9, 4).transpose(1, 2)):
        layout = BSH if x.dim() == 3 else BSHD
        assert layouts.follows(x, layout) and layouts.canonical(x, layout) is x
    assert not layouts.is_dense_in(q, BSHD) and layouts.is_dense_in(layouts.canonical(q, BSHD, dense=True), BSHD)


@pytest.mark.parametrize(
    ("make", "order"),
    [
        (lambda: torch.randn(2, 4, 9, 8), "BHSD"),  # torch.cat / the reference kernel's out
        (lambda: torch.randn(9, 2, 4, 8).permute(1, 2, 0, 3), "SBHD"),  # a host chunk of two rows
        (lambda: torch.randn(2, 1, 9, 8).expand(2, 4, 9, 8), "BSDH"),  # K/V groups broadcast to the heads
    ],
)
def test_canonical_copies_anything_else_into_the_layout(make, order):
    x = make()
    assert memory_order(x) == order and not layouts.follows(x, BSHD)
    y = layouts.canonical(x, BSHD)
    assert y is not x and torch.equal(y, x) and memory_order(y) == "BSHD" and layouts.is_dense_in(y, BSHD)


def test_tokens_joined_keeps_the_kernel_layout():
    parts = [torch.randn(2, 3, 5, 4), torch.randn(2, 1, 3, 4).transpose(1, 2), torch.randn(2, 7, 3, 4).transpose(1, 2)]
    joined = layouts.tokens_joined(parts)
    assert torch.equal(joined, torch.cat(parts, dim=2)) and memory_order(joined) == "BSHD"
    assert memory_order(torch.cat(parts, dim=2)) == "BHSD"  # what it replaces
