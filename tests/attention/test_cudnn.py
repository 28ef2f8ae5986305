"""The cuDNN attention backend on CPU: schema check, log-sum-exp layouts, the choice PyTorch's SDPA would make, the
self-probe (on fakes built from the CPU flash op), selection and its messages, and the CUDA route on meta tensors.

What this cannot show: cuDNN's own numbers and stride checks on a GPU (``benchmarks/gpu_checks.py`` checks the
backend against float64 there).
"""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_sppo.attention import (
    CudnnKernel,
    SDPAKernel,
    aten_ops,
    cudnn,
    kernels,
    select_kernel,
    subsequence_attention,
)
from lightning_sppo.attention.cudnn import TORCH_LSE, CudnnFeatures, LseLayout
from lightning_sppo.attention.kv_cache import KVCache
from lightning_sppo.attention.layouts import BSHD, is_dense_in
from lightning_sppo.partition import spans as to_spans
from tests.attention.dense import dense_attention_fp64
from tests.attention.test_cuda_routes import CUDA, OpLog, meta_is_cuda  # noqa: F401 (a fixture)

FORWARD = "aten._scaled_dot_product_cudnn_attention"
BACKWARD = "aten._scaled_dot_product_cudnn_attention_backward"
CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


# -- schemas ---------------------------------------------------------------------------------------------------


def test_this_torchs_schemas_take_what_the_op_pair_passes():
    forward, backward = cudnn.ops()
    assert cudnn.schema_problems(forward._schema, backward._schema) == []


def test_a_schema_that_differs_is_named():
    forward = torch._C.parse_schema(
        "aten::_scaled_dot_product_cudnn_attention(Tensor query, Tensor key, Tensor value, bool is_causal)"
        " -> (Tensor, Tensor)"
    )
    backward = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default._schema
    (problem,) = cudnn.schema_problems(forward, backward)[:1]
    assert "query, key, value, is_causal" in problem and "attn_bias, compute_log_sumexp" in problem
    assert len(cudnn.schema_problems(forward, backward)) == 2  # and the number of returns


def test_ops_refuse_a_differing_torch_with_the_setting_to_use(monkeypatch):
    monkeypatch.setattr(cudnn, "schema_problems", lambda *schemas: ["aten::x(a) where this code passes (b)"])
    cudnn.ops.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"aten::x\(a\).*Use attention='sdpa'"):
            cudnn.ops()
    finally:
        cudnn.ops.cache_clear()


# -- log-sum-exp layouts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("short", "long", "layout"),
    [
        ((1, 4, 17, 1), (1, 4, 33, 1), TORCH_LSE),
        ((1, 4, 17), (1, 4, 33), LseLayout(False, 1)),
        ((1, 4, 32), (1, 4, 48), LseLayout(False, 16)),
        ((1, 4, 24, 1), (1, 4, 40, 1), LseLayout(True, 8)),
        ((1, 4, 64), (1, 4, 64), LseLayout(False, 64)),
    ],
)
def test_lse_layout_is_found_from_two_query_lengths(short, long, layout):
    assert cudnn.lse_layout(short, 17, long, 33) == layout


@pytest.mark.parametrize(
    ("short", "long"), [((1, 4, 17, 2), (1, 4, 33, 2)), ((1, 4, 20), (1, 4, 33)), ((4, 17), (4, 33))]
)
def test_an_unknown_lse_layout_is_refused(short, long):
    with pytest.raises(ValueError, match="log-sum-exp shapes"):
        cudnn.lse_layout(short, 17, long, 33)


@pytest.mark.parametrize("layout", [TORCH_LSE, LseLayout(False, 1), LseLayout(False, 16), LseLayout(True, 8)])
def test_lse_converts_both_ways(layout):
    lse = torch.randn(2, 3, 17)
    op_form = cudnn.lse_to_op(lse.transpose(1, 2).contiguous().transpose(1, 2), layout)  # a strided merged lse
    padded = layout.length(17)
    assert op_form.shape == ((2, 3, padded, 1) if layout.trailing_one else (2, 3, padded))
    assert op_form.is_contiguous()
    assert torch.equal(cudnn.lse_from_op(op_form, 17), lse)
    returned = torch.randn(op_form.shape)  # what the op returns: padding rows are garbage, sliced away
    assert torch.equal(cudnn.lse_from_op(returned, 17), returned.reshape(2, 3, padded)[..., :17])


# -- the choice PyTorch's SDPA would make ---------------------------------------------------------------------------


def test_torch_picks_cudnn_asks_the_dispatcher_as_a_training_call_would(monkeypatch):
    seen = {}

    def choice(q, k, v, mask, dropout, causal, *, scale, enable_gqa):
        seen.update(grad=torch.is_grad_enabled(), leaves=all(x.requires_grad for x in (q, k, v)), gqa=enable_gqa,
                    causal=causal, scale=scale, mask=mask, dropout=dropout)  # fmt: skip
        return cudnn.cudnn_backend()

    monkeypatch.setattr(torch, "_fused_sdp_choice", choice)
    monkeypatch.setattr(cudnn, "_CHOICES", {})
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with torch.no_grad():
        assert cudnn.torch_picks_cudnn(q, k, k, True, 0.25)
    assert seen == dict(grad=True, leaves=True, gqa=True, causal=True, scale=0.25, mask=None, dropout=0.0)
    assert not q.requires_grad  # the caller's tensors are left alone
    seen.clear()
    assert cudnn.torch_picks_cudnn(q.clone(), k, k, True, 0.25) and not seen  # the same layout: asked once
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        cudnn.torch_picks_cudnn(q, k, k, True, 0.25)
    assert seen  # other enabled backends: asked again


def test_the_dispatcher_never_picks_cudnn_for_cpu_tensors():
    q = torch.randn(1, 4, 8, 16, dtype=torch.bfloat16)
    assert not cudnn.torch_picks_cudnn(q, q, q, True, 0.25)


# -- the self-probe, on fakes built from the CPU flash op ---------------------------------------------------------


def fake_ops(pad_to: int = 1, trailing: bool = True, groups: bool = True, lse_shift: float = 0.0):
    """A cuDNN-shaped op pair computing with the CPU flash op: its log-sum-exp padded to ``pad_to`` rows and with or
    without the trailing 1; refusing G < H when not ``groups``; its log-sum-exp off by ``lse_shift``."""

    def forward(q, k, v, bias, compute_lse, dropout, causal, debug, *, scale):
        assert bias is None and compute_lse and dropout == 0.0 and not debug
        if not groups and k.shape[1] != q.shape[1]:
            raise RuntimeError("cuDNN: h_q != h_k")
        out, lse = CPU_FLASH(q, k, v, 0.0, causal, scale=scale)
        padded = torch.full((*lse.shape[:2], LseLayout(trailing, pad_to).length(lse.shape[2])), float("nan"))
        padded[..., : lse.shape[2]] = lse + lse_shift
        unread = torch.empty((), dtype=torch.int64)
        return (
            out,
            padded.unsqueeze(-1) if trailing else padded,
            None,
            None,
            q.shape[2],
            k.shape[2],
            unread,
            unread,
            None,
        )

    def backward(dout, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout, causal, *, scale):
        assert (bias, cum_q, cum_k, dropout, max_q, max_k) == (None, None, None, 0.0, q.shape[2], k.shape[2])
        assert lse.is_contiguous() and dout.stride() == out.stride()
        lse = (lse[..., 0] if trailing else lse)[..., : q.shape[2]]
        return CPU_FLASH_BACKWARD(dout, q, k, v, out, lse - lse_shift, 0.0, causal, scale=scale)

    return forward, backward


def _probe(monkeypatch, ops) -> CudnnFeatures:
    monkeypatch.setattr(cudnn, "ops", lambda: ops)
    return cudnn.probe(torch.device("cpu"), aten_ops.CudnnOp, aten_ops.CPU_FLASH)


@pytest.mark.parametrize(("pad_to", "trailing"), [(1, True), (16, False), (64, True)])
def test_probe_finds_the_layout_and_native_groups(monkeypatch, pad_to, trailing):
    assert _probe(monkeypatch, fake_ops(pad_to, trailing)) == CudnnFeatures(LseLayout(trailing, pad_to), True)


def test_probe_expands_groups_an_op_refuses(monkeypatch):
    assert _probe(monkeypatch, fake_ops(groups=False)) == CudnnFeatures(TORCH_LSE, False)


def test_probe_catches_wrong_numbers(monkeypatch):
    with pytest.raises(RuntimeError, match="lse differs from the flash op's"):
        _probe(monkeypatch, fake_ops(lse_shift=0.5))


# -- selection ----------------------------------------------------------------------------------------------------


def test_cudnn_is_refused_off_cuda_naming_the_setting():
    with pytest.raises(ValueError, match=r"attention='cudnn' runs cuDNN attention on CUDA only, got device='cpu'"):
        select_kernel("cudnn", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"attention='cudnn' cannot run here \(no CUDA device\)"):
            select_kernel("cudnn", CUDA)


@pytest.fixture
def no_flash_attn(monkeypatch):
    monkeypatch.setattr(kernels, "flash_attn_status", lambda: kernels.NOT_INSTALLED)
    monkeypatch.setattr(kernels, "_LOGGED", set())
    monkeypatch.setattr(kernels, "_index", lambda device: 0)


def test_auto_takes_cudnn_where_torch_would_and_the_probe_passed(monkeypatch, no_flash_attn, caplog):
    caplog.set_level(logging.INFO, logger=kernels.__name__)
    monkeypatch.setattr(kernels, "cudnn_status", lambda device: None)
    monkeypatch.setattr(kernels, "_cudnn_probe", lambda index: CudnnFeatures(TORCH_LSE, True))
    kernel = select_kernel("auto", CUDA)
    assert isinstance(kernel, SDPAKernel) and kernel.name == "sdpa+cudnn"
    (line,) = [r for r in caplog.records if r.name == kernels.__name__]
    assert "cuDNN attention wherever PyTorch's SDPA would pick it" in line.getMessage()
    assert line.levelno == logging.INFO
    assert not isinstance(select_kernel("sdpa", CUDA)._cudnn, aten_ops.CudnnOp)  # explicit sdpa: the flash op


def test_auto_falls_back_to_the_flash_op_with_one_line_saying_why(monkeypatch, no_flash_attn, caplog):
    caplog.set_level(logging.INFO, logger=kernels.__name__)
    why = kernels.NO_CUDNN_PROBE + "RuntimeError: dk differs from the flash op's by 0.5"
    monkeypatch.setattr(kernels, "cudnn_status", lambda device: why)
    for _ in range(2):
        kernel = select_kernel("auto", CUDA)
        assert type(kernel) is SDPAKernel and kernel.name == "sdpa"
    (line,) = [r for r in caplog.records if r.name == kernels.__name__]
    assert why in line.getMessage() and "flash-attn is not installed" in line.getMessage()
    assert line.levelno == logging.WARNING  # a backend that disagrees with the flash op is worth a warning


def test_flash_attn_keeps_its_place(monkeypatch):
    monkeypatch.setattr(kernels, "flash_attn_status", lambda: None)
    monkeypatch.setattr(kernels, "_load_flash_attn", lambda: (object(), (2, 7)))
    monkeypatch.setattr(kernels, "cudnn_status", lambda device: pytest.fail("cuDNN asked for with flash-attn there"))
    assert select_kernel("auto", CUDA).name == "flash_attn"


def test_status_without_cuda_says_so():
    assert kernels.cudnn_status(torch.device("cpu")) == "no CUDA device"


# -- the CUDA route on meta tensors ---------------------------------------------------------------------------------


def _meta(*shape, dtype=torch.bfloat16):
    """[B, heads, S, Dh] views of sequence-major memory, as the projections and the K/V cache give them."""
    B, heads, S, Dh = shape
    return torch.empty(B, S, heads, Dh, device="meta", dtype=dtype).transpose(1, 2)


@pytest.mark.usefixtures("meta_is_cuda")
@pytest.mark.parametrize("groups", [True, False])
def test_cudnn_route_passes_what_the_op_takes(groups):
    kernel = CudnnKernel(aten_ops.CudnnOp(CudnnFeatures(TORCH_LSE, groups)))
    q, k, v = _meta(2, 8, 48, 64), _meta(2, 2, 48, 64), _meta(2, 2, 48, 64)
    with OpLog() as log:
        out, lse = kernel.forward(q, k, v, True, 0.125)
        dout = torch.empty(2, 8, 48, 64, device="meta", dtype=torch.bfloat16)  # contiguous: not out's strides
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, True, 0.125)
    (fwd,), (bwd,) = log.named(FORWARD), log.named(BACKWARD)
    # (dispatch drops trailing defaults: return_debug_mask=False)
    assert fwd[1].shape[1] == (2 if groups else 8) and fwd[3:] == (None, True, 0.0, True)
    assert lse.shape == (2, 8, 48) and out.shape == q.shape
    assert bwd[0].stride() == out.stride() and bwd[5].shape == (2, 8, 48, 1) and bwd[5].is_contiguous()
    assert bwd[8:15] == (None, None, None, 48, 48, 0.0, True)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.usefixtures("meta_is_cuda")
def test_cudnn_backward_gets_out_dense_and_dout_alike_whatever_came():
    """The backward's graph cache is keyed by q, k, v: out (the first queries of every row, as documents' prefix
    calls pass it) is made dense in its layout and dout takes its strides, so their strides follow from q's shape."""
    kernel = CudnnKernel(aten_ops.CudnnOp(CudnnFeatures(TORCH_LSE, True)))
    q, k = _meta(2, 8, 48, 64), _meta(2, 8, 96, 64)
    out = _meta(2, 8, 96, 64)[:, :, :48]  # BSHD, but each row 96 tokens apart: not dense
    dout = torch.empty(2, 8, 48, 64, device="meta", dtype=torch.bfloat16)  # BHSD: the boundary lays it out
    lse = torch.empty(2, 8, 48, device="meta")
    assert not is_dense_in(out, BSHD)
    with OpLog() as log:
        kernel.backward(dout, q, k, k, out, lse, False, 0.125)
    ((grad_out, *_, op_out, op_lse), *_) = [args[:6] for args in log.named(BACKWARD)]
    assert is_dense_in(op_out, BSHD) and grad_out.stride() == op_out.stride() and op_lse.is_contiguous()


@pytest.mark.usefixtures("meta_is_cuda")
def test_a_rectangular_causal_call_never_reaches_cudnn():
    """PyTorch's dense cuDNN path aligns a causal mask top-left; the engine's rectangular calls are non-causal."""
    kernel = CudnnKernel(aten_ops.CudnnOp(CudnnFeatures(TORCH_LSE, True)))
    q, k = _meta(1, 8, 16, 64), _meta(1, 8, 48, 64)
    with OpLog() as log:
        with pytest.raises(ValueError, match="square causal attention only.*got 16 queries over 48 keys"):
            kernel.forward(q, k, k, True, 0.125)
        out, lse = kernel.forward(q, k, k, False, 0.125)
        with pytest.raises(ValueError, match="square causal attention only"):
            kernel.backward(out, q, k, k, out, lse, True, 0.125)
    assert len(log.named(FORWARD)) == 1 and not log.named(BACKWARD)  # only the non-causal call ran


@pytest.mark.usefixtures("meta_is_cuda")
@pytest.mark.parametrize(
    ("head_size", "keys", "limit", "why"),
    [
        (12, 48, 256, "head size 12: cuDNN attention takes multiples of 8 up to 256 here"),
        (264, 48, 256, "head size 264: "),
        (256, 48, 128, r"head size 256: .* up to 128 here"),
        (64, 1, 256, "1 key: cuDNN attention takes at least 2"),
    ],
)
def test_explicit_cudnn_refuses_shapes_the_dispatcher_never_sends_it_naming_the_setting(
    monkeypatch, head_size, keys, limit, why
):
    kernel = CudnnKernel(aten_ops.CudnnOp(CudnnFeatures(TORCH_LSE, True)), head_limit=limit)
    q, k = _meta(1, 8, 48, head_size), _meta(1, 8, keys, head_size)
    with pytest.raises(ValueError, match=rf"^attention='cudnn' cannot run this call \({why}.*use attention='auto'"):
        kernel.forward(q, k, k, keys == 48, 0.125)
    monkeypatch.setattr(cudnn, "shape_problem", lambda *args: None)  # negative control: without the gate ...
    with OpLog() as log:
        kernel.forward(q, k, k, keys == 48, 0.125)
    assert len(log.named(FORWARD)) == 1  # ... the op gets the call (on a GPU: a RuntimeError from inside, or worse)


@pytest.mark.usefixtures("meta_is_cuda")
def test_subsequences_over_the_cache_take_cudnn_for_square_and_prefix_calls():
    kernel = CudnnKernel(aten_ops.CudnnOp(CudnnFeatures(TORCH_LSE, True)))
    lengths, S = [40, 24], 64
    leaves = [_meta(1, n, S, 64).requires_grad_() for n in (8, 2, 2)]
    cache = KVCache(S, last_offset=40)
    with OpLog() as log:
        outs = [subsequence_attention(*(x[:, :, o : o + n] for x in leaves), cache, o, kernel)
                for o, n in to_spans(lengths)]  # fmt: skip
        for out in reversed(outs):
            out.backward(torch.empty_like(out))
    causal = [len(args) > 6 and args[6] for args in log.named(FORWARD)]  # is_causal=False is dropped as a default
    assert causal == [True, True, False]  # subsequence 0; subsequence 1's diagonal, then its prefix
    assert [(args[2].shape[2], args[14]) for args in log.named(BACKWARD)] == [(24, True), (40, False), (40, True)]
    assert not log.named("aten._scaled_dot_product_flash_attention")


def test_explicit_cudnn_runs_where_the_probe_passed_and_names_why_not(monkeypatch):
    monkeypatch.setattr(kernels, "_usable_index", lambda device: 0)
    monkeypatch.setattr(kernels, "_cudnn_probe", lambda index: CudnnFeatures(TORCH_LSE, False))
    assert select_kernel("cudnn", CUDA).name == "cudnn"
    monkeypatch.setattr(kernels, "_cudnn_probe", lambda index: "RuntimeError: out differs from the flash op's by 1")
    with pytest.raises(ValueError, match=r"attention='cudnn' cannot run here \(RuntimeError: out differs.*'sdpa'"):
        select_kernel("cudnn", CUDA)


@pytest.mark.parametrize(("layout", "groups"), [(TORCH_LSE, True), (LseLayout(False, 16), False)])
def test_subsequences_through_the_cudnn_pair_equal_dense_attention(monkeypatch, layout, groups):
    """The op pair's conventions end to end (log-sum-exp both ways, merged out/lse fed back, GQA expanded or not,
    dout re-strided), with the fake op pair standing in for cuDNN: uneven subsequences against float64."""
    monkeypatch.setattr(cudnn, "ops", lambda: fake_ops(layout.tile, layout.trailing_one, groups))
    monkeypatch.setattr(kernels, "fused_op", lambda device, dtype: aten_ops.CUDA_FLASH)  # the CUDA half route
    kernel = CudnnKernel(aten_ops.CudnnOp(CudnnFeatures(layout, groups)))
    lengths = [30, 21, 13]
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1, n, sum(lengths), 16, generator=gen, dtype=torch.bfloat16).requires_grad_()
              for n in (4, 2, 2)]  # fmt: skip
    cache, outs = KVCache(sum(lengths), last_offset=to_spans(lengths)[-1][0]), []
    for o, n in to_spans(lengths):
        outs.append(subsequence_attention(*(x[:, :, o : o + n] for x in leaves), cache, o, kernel))
    dout = torch.randn(1, 4, sum(lengths), 16, generator=gen, dtype=torch.bfloat16)
    for (o, n), out in reversed(list(zip(to_spans(lengths), outs, strict=True))):
        out.backward(dout[:, :, o : o + n])
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref = dense_attention_fp64(*ref_leaves)
    ref.backward(dout.double())
    for got, want in [(torch.cat([o.detach() for o in outs], 2), ref), *((x.grad, r.grad) for x, r in zip(leaves, ref_leaves, strict=True))]:  # fmt: skip
        assert ((got.double() - want).norm() / want.norm()).item() < 2e-2
