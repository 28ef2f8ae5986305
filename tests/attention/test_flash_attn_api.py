"""flash-attn detection and its 2.6 / 2.7+ interfaces, without flash-attn installed.

Fake ``flash_attn`` packages go into ``sys.modules``: 2.6.3 with the 2.6 signatures (``window_size=(l, r)``,
8 return values, the log-sum-exp at index 5) and 2.7.4 whose functions are ``(*args, **kwargs)`` like the real
``torch.library`` custom ops (``window_size_left``/``_right``, 4 return values). Both compute attention in
fp64 from the inputs they are given, so the kernel's layout, keyword and return handling is checked by value
against an independent dense attention. A third fake fails on import, as a wheel built for another torch does.
CUDA is reported available (``torch.cuda.is_available`` patched) so that the selection logic runs; no CUDA
call is made.
"""

from __future__ import annotations

import logging
import math
import sys
from types import ModuleType

import pytest
import torch

from lightning_sppo.attention import kernels
from lightning_sppo.attention.kernels import FlashAttnKernel, SDPAKernel, select_kernel
from tests.attention.dense import dense_attention_fp64

CUDA = torch.device("cuda")


def _attention_fp64(q, k, v, causal, scale):
    """Reference on [B, S, heads, Dh] inputs: out [B, Sq, H, Dh] and lse [B, H, Sq] in fp64."""
    qd, kd, vd = (x.transpose(1, 2).double() for x in (q, k, v))
    kd, vd = (x.repeat_interleave(qd.shape[1] // x.shape[1], dim=1) for x in (kd, vd))
    scores = qd @ kd.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(scores, -1) @ vd).transpose(1, 2), scores.logsumexp(-1)


def _grads_fp64(dout, q, k, v, causal, scale):
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out, _ = _attention_fp64(*leaves, causal, scale)
    out.backward(dout.double())
    return [x.grad for x in leaves]


class FakeFlashAttn:
    """The two interfaces as flash-attn defines them; records every call's keyword arguments."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.calls: list[tuple[str, dict]] = []
        package, interface = ModuleType("flash_attn"), ModuleType("flash_attn.flash_attn_interface")
        package.__version__ = version
        package.flash_attn_interface = interface
        if version.startswith("2.6"):
            interface._flash_attn_forward = self.forward_26
            interface._flash_attn_backward = self.backward_26
            interface._flash_attn_varlen_forward = self.varlen_forward_26
            interface._flash_attn_varlen_backward = self.varlen_backward_26
        else:  # 2.7+: custom ops, whose Python signature says nothing
            interface._flash_attn_forward = lambda *args, **kwargs: self.forward_27(*args, **kwargs)
            interface._flash_attn_backward = lambda *args, **kwargs: self.backward_27(*args, **kwargs)
            interface._flash_attn_varlen_forward = lambda *args, **kwargs: self.varlen_forward_27(*args, **kwargs)
            interface._flash_attn_varlen_backward = lambda *args, **kwargs: self.varlen_backward_27(*args, **kwargs)
        self.modules = {"flash_attn": package, "flash_attn.flash_attn_interface": interface}

    def _forward(self, q, k, v, softmax_scale, causal):
        out, lse = _attention_fp64(q, k, v, causal, softmax_scale)
        return out.to(q.dtype), lse.float()

    def _backward(self, dout, q, k, v, dq, dk, dv, softmax_scale, causal):
        for buffer, grad in zip((dq, dk, dv), _grads_fp64(dout, q, k, v, causal, softmax_scale), strict=True):
            buffer.copy_(grad)  # flash-attn overwrites the buffers it is given
        return torch.zeros(1)

    def forward_26(self, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   return_softmax):  # fmt: skip
        self.calls.append(("forward", {"window_size": window_size, "causal": causal}))
        out, lse = self._forward(q, k, v, softmax_scale, causal)
        # (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state): a wrong index picks q or out, not lse
        return out, q, k, v, out, lse, None, torch.zeros(2)

    def backward_26(self, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                    softcap, alibi_slopes, deterministic, rng_state=None):  # fmt: skip
        self.calls.append(("backward", {"window_size": window_size, "deterministic": deterministic}))
        return self._backward(dout, q, k, v, dq, dk, dv, softmax_scale, causal)

    def forward_27(self, q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                   alibi_slopes, return_softmax):  # fmt: skip
        self.calls.append(("forward", {"window_size_left": window_size_left, "window_size_right": window_size_right}))
        out, lse = self._forward(q, k, v, softmax_scale, causal)
        return out, lse, None, torch.zeros(2)

    def backward_27(self, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                    window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):  # fmt: skip
        window = {"window_size_left": window_size_left, "window_size_right": window_size_right}
        self.calls.append(("backward", {**window, "deterministic": deterministic}))
        return self._backward(dout, q, k, v, dq, dk, dv, softmax_scale, causal)

    # -- varlen: q, k, v [total, heads, Dh]; every piece [cu[i], cu[i + 1]) alone; lse [H, total] ---------------

    def _varlen_forward(self, q, k, v, cu, max_seqlen, softmax_scale, causal):
        bounds = cu.tolist()
        assert max_seqlen == max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
        outs, lses = [], []
        for a, e in zip(bounds, bounds[1:], strict=False):
            out, lse = self._forward(*(x[None, a:e] for x in (q, k, v)), softmax_scale, causal)
            outs.append(out[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)  # [total, H, Dh], [H, total]

    def _varlen_backward(self, dout, q, k, v, dq, dk, dv, cu, softmax_scale, causal):
        bounds = cu.tolist()
        for a, e in zip(bounds, bounds[1:], strict=False):
            grads = _grads_fp64(*(x[None, a:e] for x in (dout, q, k, v)), causal, softmax_scale)
            for buffer, grad in zip((dq, dk, dv), grads, strict=True):
                buffer[a:e] = grad[0]
        return torch.zeros(1)

    def varlen_forward_26(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                          softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                          return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None):  # fmt: skip
        self.calls.append(("varlen_forward", {"window_size": window_size, "cu_seqlens": cu_seqlens_q.tolist()}))
        assert cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k
        out, lse = self._varlen_forward(q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale, causal)
        return out, q, k, v, out, lse, None, torch.zeros(2)

    def varlen_backward_26(self, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                           max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, rng_state=None):  # fmt: skip
        self.calls.append(("varlen_backward", {"window_size": window_size, "lse_shape": tuple(softmax_lse.shape)}))
        return self._varlen_backward(dout, q, k, v, dq, dk, dv, cu_seqlens_q, softmax_scale, causal)

    def varlen_forward_27(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                          softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                          alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None,
                          zero_tensors=False):  # fmt: skip
        window = {"window_size_left": window_size_left, "window_size_right": window_size_right}
        self.calls.append(("varlen_forward", {**window, "cu_seqlens": cu_seqlens_q.tolist()}))
        out, lse = self._varlen_forward(q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale, causal)
        return out, lse, None, torch.zeros(2)

    def varlen_backward_27(self, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                           max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                           window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                           zero_tensors=False):  # fmt: skip
        window = {"window_size_left": window_size_left, "window_size_right": window_size_right}
        self.calls.append(("varlen_backward", {**window, "lse_shape": tuple(softmax_lse.shape)}))
        return self._varlen_backward(dout, q, k, v, dq, dk, dv, cu_seqlens_q, softmax_scale, causal)


@pytest.fixture
def cuda_reported(monkeypatch):
    """Selection sees a CUDA device; the log-once memory starts empty."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "_LOGGED", set())
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)


def _install(monkeypatch, fake: FakeFlashAttn) -> FakeFlashAttn:
    for name, module in fake.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return fake


@pytest.mark.parametrize(
    ("version", "window"),
    [("2.6.3", {"window_size": (-1, -1)}), ("2.7.4", {"window_size_left": -1, "window_size_right": -1})],
)
@pytest.mark.parametrize(("causal", "sq", "sk", "groups"), [(True, 12, 12, 2), (False, 5, 17, 4), (False, 9, 9, 1)])
def test_each_version_gets_its_keywords_and_its_log_sum_exp(monkeypatch, cuda_reported, version, window, causal, sq,
                                                             sk, groups):  # fmt: skip
    fake = _install(monkeypatch, FakeFlashAttn(version))
    kernel = select_kernel("auto", CUDA)
    assert isinstance(kernel, FlashAttnKernel) and kernel.version == tuple(map(int, version.split(".")[:2]))

    q = torch.randn(2, 4, sq, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(2, groups, sk, 16, dtype=torch.bfloat16) for _ in range(2))
    scale = 1 / math.sqrt(16)
    out, lse = kernel.forward(q, k, v, causal, scale)
    assert fake.calls[-1][1].items() >= window.items()

    ref = dense_attention_fp64(q, k, v, causal)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    _, ref_lse = _attention_fp64(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)  # index 5 (2.6) / 1 (2.7+)

    dout = torch.randn_like(q)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, scale)
    assert fake.calls[-1][0] == "backward" and fake.calls[-1][1].items() >= (window | {"deterministic": False}).items()
    want = _grads_fp64(dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale)
    for got, ref_grad in zip((dq, dk, dv), want, strict=True):
        ref_grad = ref_grad.transpose(1, 2)
        assert got.shape == ref_grad.shape  # native GQA: dK/dV come back per group
        assert ((got.double() - ref_grad).norm() / ref_grad.norm()).item() < 1e-2


def test_negative_control_the_27_op_refuses_the_26_keyword(monkeypatch, cuda_reported):
    """What the old signature check did with 2.7+: it read ``(*args, **kwargs)``, passed window_size=, and crashed."""
    fake = _install(monkeypatch, FakeFlashAttn("2.7.4"))
    kernel = FlashAttnKernel(fake.modules["flash_attn.flash_attn_interface"], (2, 6))  # as if detected as 2.6
    q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="window_size"):
        kernel.forward(q, q, q, True, 0.3)


def test_deterministic_algorithms_reach_the_backward(monkeypatch, cuda_reported):
    fake = _install(monkeypatch, FakeFlashAttn("2.7.4"))
    kernel = select_kernel("flash_attn", CUDA)
    q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    out, lse = kernel.forward(q, q, q, True, 0.3)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    kernel.backward(torch.randn_like(q), q, q, q, out, lse, True, 0.3)
    assert fake.calls[-1][1]["deterministic"] is True


def test_fp32_goes_to_pytorchs_kernels(monkeypatch, cuda_reported):
    fake = _install(monkeypatch, FakeFlashAttn("2.7.4"))
    kernel = select_kernel("flash_attn", CUDA)
    q = torch.randn(1, 2, 4, 8)
    out, lse = kernel.forward(q, q, q, True, 0.3)  # CPU tensors: SDPAKernel's CPU op
    assert not fake.calls
    want, want_lse = SDPAKernel().forward(q, q, q, True, 0.3)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def _broken_package(tmp_path, monkeypatch, version: str = "2.7.4") -> None:
    """flash_attn whose interface fails to load, like a wheel built against another torch."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (package / "flash_attn_interface.py").write_text(
        'raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def test_auto_falls_back_with_one_log_line_when_the_import_fails(tmp_path, monkeypatch, cuda_reported, caplog):
    _broken_package(tmp_path, monkeypatch)
    caplog.set_level(logging.INFO, logger=kernels.__name__)
    first, second = select_kernel("auto", CUDA), select_kernel("auto", CUDA)
    assert isinstance(first, SDPAKernel) and isinstance(second, SDPAKernel)
    lines = [r for r in caplog.records if r.name == kernels.__name__]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "undefined symbol" in lines[0].getMessage() and "sdpa" in lines[0].getMessage()


def test_an_explicit_choice_that_cannot_import_names_the_fix(tmp_path, monkeypatch, cuda_reported):
    _broken_package(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match=r"attention='flash_attn' cannot run here.*undefined symbol.*pip install"):
        select_kernel("flash_attn", CUDA)


def test_too_old_a_version_is_refused(tmp_path, monkeypatch, cuda_reported):
    fake = FakeFlashAttn("2.5.9")
    _install(monkeypatch, fake)
    with pytest.raises(ValueError, match=r"flash-attn>=2.6 is required, found 2.5.9"):
        select_kernel("flash_attn", CUDA)
    assert isinstance(select_kernel("auto", CUDA), SDPAKernel)


def test_not_installed_is_an_info_line(monkeypatch, cuda_reported, caplog):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ModuleNotFoundError(name="flash_attn")
    caplog.set_level(logging.INFO, logger=kernels.__name__)
    assert isinstance(select_kernel("auto", CUDA), SDPAKernel)
    (line,) = [r for r in caplog.records if r.name == kernels.__name__]
    assert line.levelno == logging.INFO and "flash-attn is not installed" in line.getMessage()


def test_cpu_never_takes_flash_attn(monkeypatch, cuda_reported):
    _install(monkeypatch, FakeFlashAttn("2.7.4"))
    assert isinstance(select_kernel("auto", torch.device("cpu")), SDPAKernel)
    with pytest.raises(ValueError, match="device='cpu' is not CUDA"):
        select_kernel("flash_attn", torch.device("cpu"))


@pytest.mark.parametrize(
    ("version", "window"),
    [("2.6.3", {"window_size": (-1, -1)}), ("2.7.4", {"window_size_left": -1, "window_size_right": -1})],
)
def test_documents_take_the_varlen_functions_of_each_version(monkeypatch, cuda_reported, version, window):
    """Packed documents: one varlen call over the rows laid end to end (cu_seqlens over both rows), the
    log-sum-exp [H, total] read back per row, against block-diagonal causal attention in fp64."""
    from lightning_sppo.documents import Documents
    from tests.attention.test_documents import masked_attention_fp64
    from tests.conftest import document_ids_from_lengths

    fake = _install(monkeypatch, FakeFlashAttn(version))
    kernel = select_kernel("flash_attn", CUDA)
    document_ids = document_ids_from_lengths([[3, 1, 8], [12]])
    pieces = Documents.from_ids(document_ids).window(0, 12)
    q = torch.randn(2, 4, 12, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 12, 16, dtype=torch.bfloat16) for _ in range(2))
    scale = 1 / math.sqrt(16)
    out, lse = kernel.forward(q, k, v, True, scale, pieces=pieces)
    assert fake.calls[-1] == ("varlen_forward", window | {"cu_seqlens": [0, 3, 4, 12, 24]})

    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = masked_attention_fp64(*leaves, document_ids, scale)
    assert out.shape == q.shape and ((out.double() - ref.detach()).norm() / ref.norm()).item() < 1e-2
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=1e-5, atol=1e-5)

    dout = torch.randn_like(q)
    ref.backward(dout.double())
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, True, scale, pieces=pieces)
    assert fake.calls[-1] == ("varlen_backward", window | {"lse_shape": (4, 24)})
    for got, leaf in zip((dq, dk, dv), leaves, strict=True):
        assert got.shape == leaf.shape
        assert ((got.double() - leaf.grad).norm() / leaf.grad.norm()).item() < 1e-2
