"""The CUDA kernel routes, checked on CPU with meta tensors.

What this can show without a GPU: which ATen op each CUDA dtype reaches; that those ops' schemas take the
arguments as passed (positions, keywords, ``None`` for undefined tensors); that their meta shape functions
agree with the slicing and re-padding of the memory-efficient op's log-sum-exp and with unexpanded GQA K/V;
and that no CUDA route computes a score matrix (no matmul in the dispatched ops) or reaches the reference
kernel. What it cannot show: the kernels' numbers, their stride and alignment checks, or what the CUDA
backward reads from the padding (``benchmarks/gpu_suite.py`` checks those on a GPU against fp64).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_sppo.attention import (
    KVCache,
    ReferenceKernel,
    SDPAKernel,
    aten_ops,
    kernels,
    select_kernel,
    subsequence_attention,
)
from lightning_sppo.documents import Documents
from lightning_sppo.partition import spans as to_spans
from tests.conftest import document_ids_from_lengths

CUDA = torch.device("cuda")
SCORE_OPS = {"aten.mm", "aten.bmm", "aten.matmul", "aten.baddbmm", "aten.addmm"}


class OpLog(TorchDispatchMode):
    """Every ATen op dispatched inside, with its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func.overloadpacket), args))
        return func(*args, **(kwargs or {}))

    def named(self, name: str) -> list[tuple]:
        return [args for op, args in self.calls if op == name]


@pytest.fixture
def meta_is_cuda(monkeypatch):
    """Meta tensors take the CUDA routes; the reference kernel must not run."""
    route = kernels.fused_op
    monkeypatch.setattr(
        kernels, "fused_op", lambda device, dtype: route(CUDA if device.type == "meta" else device, dtype)
    )

    def refuse(*args, **kwargs):
        raise AssertionError("the reference kernel ran on a CUDA route")

    monkeypatch.setattr(ReferenceKernel, "forward", refuse)
    monkeypatch.setattr(ReferenceKernel, "backward", refuse)


@pytest.mark.parametrize(
    ("dtype", "route"),
    [
        (torch.bfloat16, aten_ops.CudaFlashOp),
        (torch.float16, aten_ops.CudaFlashOp),
        (torch.float32, aten_ops.CudaEfficientOp),
    ],
)
def test_every_cuda_dtype_has_a_fused_route(dtype, route):
    assert isinstance(kernels.fused_op(CUDA, dtype), route)
    assert isinstance(kernels.fused_op(torch.device("cpu"), dtype), aten_ops.CpuFlashOp)


def test_fp64_on_cuda_is_refused_with_the_setting_to_use():
    with pytest.raises(ValueError, match=r'dtype=torch.float64.*precision="bf16-mixed"'):
        kernels.fused_op(CUDA, torch.float64)


def test_only_an_explicit_choice_gives_the_reference_kernel_on_cuda(caplog):
    caplog.set_level(logging.WARNING, logger=kernels.__name__)
    for name in ("auto", "sdpa"):
        assert isinstance(select_kernel(name, CUDA), SDPAKernel)
    assert isinstance(select_kernel("reference", CUDA), ReferenceKernel)
    assert any("for tests only" in r.getMessage() for r in caplog.records)


def _run_subsequences(
    dtype: torch.dtype,
    lengths: list[int],
    heads: int = 8,
    groups: int = 2,
    head_size: int = 64,
    rows: list[list[int]] | None = None,
):
    """Forward 0..N-1 and backward N-1..0 of subsequence attention on meta tensors, under an op log; with ``rows``
    (one list of document lengths per row), over packed documents."""
    documents, batch, seq_len = None, 1, sum(lengths)
    if rows is not None:
        document_ids = document_ids_from_lengths(rows)
        batch, seq_len = document_ids.shape
        documents = Documents.from_ids(document_ids, device="meta")
    leaves = [torch.empty(batch, n, seq_len, head_size, device="meta", dtype=dtype, requires_grad=True)
              for n in (heads, groups, groups)]  # fmt: skip
    cache = KVCache(seq_len)
    with OpLog() as log:
        outs = [
            subsequence_attention(*(x[:, :, off : off + n] for x in leaves), cache, off, SDPAKernel(), documents)
            for off, n in to_spans(lengths)
        ]
        for out in reversed(outs):
            out.backward(torch.empty_like(out))
    for leaf in leaves:
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape
    return log


@pytest.mark.usefixtures("meta_is_cuda")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_the_flash_op_with_unexpanded_groups(dtype):
    log = _run_subsequences(dtype, [96, 64, 40])
    forwards = log.named("aten._scaled_dot_product_flash_attention")
    backwards = log.named("aten._scaled_dot_product_flash_attention_backward")
    assert len(forwards) == len(backwards) == 5  # a diagonal call per subsequence, a prefix call for the last two
    for args in forwards:
        q, k, v = args[:3]
        assert (q.shape[1], k.shape[1], v.shape[1]) == (8, 2, 2)  # native GQA: K/V groups as they are
    for args in backwards:
        dout, q, k, v, out, lse = args[:6]
        assert k.shape[1] == 2 and lse.is_contiguous() and lse.shape == q.shape[:3]
    assert not SCORE_OPS & {op for op, _ in log.calls}
    assert not log.named("aten.clone")  # no expanded K/V, and no copies of out / dout for the backward


@pytest.mark.usefixtures("meta_is_cuda")
def test_fp32_runs_the_memory_efficient_op_and_repads_its_log_sum_exp():
    lengths = [100, 60]  # 100 queries: the op's log-sum-exp has 128 rows
    log = _run_subsequences(torch.float32, lengths)
    forwards = log.named("aten._scaled_dot_product_efficient_attention")
    backwards = log.named("aten._scaled_dot_product_efficient_attention_backward")
    assert len(forwards) == len(backwards) == 3
    for args in forwards:
        q, k = args[:2]
        assert k.shape[1] == q.shape[1]  # this op needs H == G: expanded
        assert args[4] is True  # compute_log_sumexp
    for args in backwards:
        q, lse = args[1], args[6]
        rows = q.shape[2]
        assert lse.shape == (*q.shape[:2], -(-rows // 32) * 32) and lse.is_contiguous()
    assert not SCORE_OPS & {op for op, _ in log.calls}


def test_the_efficient_ops_padded_log_sum_exp_is_sliced_for_the_merge():
    q = torch.empty(1, 4, 100, 64, device="meta")
    out, lse = aten_ops.CudaEfficientOp().forward(q, q, q, False, 0.125)
    assert out.shape == q.shape and lse.shape == (1, 4, 100)
    raw = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.0, False, scale=0.125)[1]
    assert raw.shape == (1, 4, 128)  # negative control: unsliced, it would not merge with a [1, 4, 100] partial


def test_cpu_flash_op_takes_groups_in_this_torch(monkeypatch):
    """torch 2.13's CPU op reads G < H itself; the probe finds it, so no CPU call expands K/V either."""
    assert aten_ops.cpu_flash_takes_groups()
    monkeypatch.setattr(aten_ops, "cpu_flash_takes_groups", lambda: False)  # negative control: an older torch
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    with OpLog() as log:
        SDPAKernel().forward(q, k, k, True, 0.3)
    assert log.named("aten.repeat_interleave") or log.named("aten.clone")
    monkeypatch.undo()
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    with OpLog() as log:
        out, lse = SDPAKernel().forward(q, k, k, True, 0.3)
        SDPAKernel().backward(torch.randn_like(out), q, k, k, out, lse, True, 0.3)
    assert not [args for args in log.named("aten.clone") if args[0].dim() == 4]  # (the small lse may be copied)
    assert not log.named("aten.repeat_interleave")


@pytest.mark.usefixtures("meta_is_cuda")
@pytest.mark.parametrize("batch", [1, 2])
def test_documents_in_half_precision_run_the_varlen_flash_op(batch):
    """One varlen call per subsequence that holds a document boundary, with cu_seqlens over the rows laid end to
    end and a [H, total] log-sum-exp; dense prefix calls only for rows whose document began earlier."""
    rows = [[100, 20, 80], [30, 170]][:batch]  # subsequences [0, 96), [96, 160), [160, 200)
    log = _run_subsequences(torch.bfloat16, [96, 64, 40], rows=rows)
    varlen = log.named("aten._flash_attention_forward")
    varlen_backward = log.named("aten._flash_attention_backward")
    # Row 0 has boundaries at 100 and 120 (inside [96, 160) only); row 1 at 30 (inside [0, 96)).
    assert len(varlen) == len(varlen_backward) == batch
    for args in varlen:
        q, k, v, cu_q, cu_k, max_q, max_k = args[:7]
        assert q.dim() == 3 and q.shape[0] in (batch * 96, batch * 64) and (q.shape[1], k.shape[1]) == (8, 2)
        assert cu_q is cu_k and cu_q.dtype == torch.int32 and args[8] is True  # is_causal
    for args in varlen_backward:
        dout, q, k, v, out, lse, cu_q, cu_k = args[:8]
        assert lse.shape == (8, q.shape[0]) and lse.is_contiguous()  # [H, total]
    dense = log.named("aten._scaled_dot_product_flash_attention")
    prefixes = [
        (args[0].shape[0], args[0].shape[2], args[1].shape[2]) for args in dense if len(args) < 5 or not args[4]
    ]
    if batch == 1:  # at 96: queries 96..99 over keys 0..95; at 160: queries 160..199 over keys 120..159
        assert prefixes == [(1, 4, 96), (1, 40, 40)]
    assert not SCORE_OPS & {op for op, _ in log.calls}


@pytest.mark.usefixtures("meta_is_cuda")
def test_documents_in_fp32_run_the_memory_efficient_op_per_piece():
    log = _run_subsequences(torch.float32, [100, 60], rows=[[30, 100, 30]])
    forwards = log.named("aten._scaled_dot_product_efficient_attention")
    # [0, 100): pieces of 30 and 70; [100, 160): pieces of 30 and 30, plus the prefix [30, 100) of the first.
    assert sorted(args[0].shape[2] for args in forwards) == [30, 30, 30, 30, 70]
    assert len(log.named("aten._scaled_dot_product_efficient_attention_backward")) == 5
    assert not log.named("aten._flash_attention_forward")
    assert not SCORE_OPS & {op for op, _ in log.calls}
