"""The layer-major engine (FPDT's order, chunk-major attention backward) against the plain model (fp32, CPU)."""

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.attention import chunk_major
from lightning_sppo.planner.layer_order import kept_bytes_per_token, kv_peak_bytes
from lightning_sppo.planner.precision import precision_bytes
from lightning_sppo.recompute import apply_recompute
from lightning_sppo.runtime import LayerMajorEngine, SubsequenceEngine, layer_major
from tests.attention.test_kv_spill import DeferredCopies
from tests.conftest import IGNORE, make_batch, max_relative_error, parity_config, plain_loss_and_grads
from tests.runtime import streamed_kv

S = 45  # a multiple of none of the chunk counts below


def _check_parity(model, ids, targets, engine, document_ids=None, ref=None):
    ref_loss, ref_grads = ref or plain_loss_and_grads(model, ids, targets)
    loss = engine.forward_backward(model, ids, targets, document_ids)
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-5
    err, where = max_relative_error(ref_grads, model)
    assert err < 1e-5, f"{where}: {err}"


@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.parametrize("num_chunks", [1, 2, 3, 5])
@pytest.mark.parametrize(("gqa", "batch_size"), [(False, 2), (True, 1)], ids=["mha-b2", "gqa-b1"])
def test_forward_backward_equals_plain_model(num_chunks, recompute, gqa, batch_size):
    config = parity_config(gqa)
    model = GPT(config)
    ids, targets = make_batch(config, batch_size, S)
    engine = LayerMajorEngine(num_chunks, recompute=recompute)
    _check_parity(model, ids, targets, engine)
    assert len(engine.plan(ids, config).lengths) == num_chunks


@pytest.mark.parametrize("device_tokens", [0, 17])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_checkpoints_and_kv_on_host_change_nothing(recompute, device_tokens):
    """offload='full' sends every layer's checkpoints but the last to host; K/V beyond ``device_tokens`` live on host
    and stream back in 7-token chunks, which straddle the 9-token layer chunks."""
    config = parity_config(True, n_layer=3)
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    engine = LayerMajorEngine(5, recompute=recompute, offload="full", kv_device_tokens=device_tokens, kv_chunk_tokens=7)
    _check_parity(model, ids, targets, engine)
    assert engine.cache_host_nbytes() > 0


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_packed_documents_equal_the_plain_model_with_documents(recompute):
    config = parity_config(True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    # Documents that start inside chunks, across chunk boundaries, and a row whose only document spans all chunks.
    document_ids = torch.tensor([[0] * 5 + [1] * 14 + [2] * 20 + [3] * 6, [0] * S])
    ref = copy.deepcopy(model)
    logits = ref(ids, document_ids=document_ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    loss.backward()
    ref_grads = {name: p.grad.clone() for name, p in ref.named_parameters()}
    engine = LayerMajorEngine(4, recompute=recompute, kv_device_tokens=10, kv_chunk_tokens=8)
    _check_parity(model, ids, targets, engine, document_ids, ref=(loss.detach(), ref_grads))


@pytest.mark.parametrize("name", ["tiny-gelu", "tiny-gqa"])
def test_other_architectures_and_tied_embeddings(name):
    config = GPTConfig.from_name(name, tie_embeddings=True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, 37)
    _check_parity(model, ids, targets, LayerMajorEngine(3, attention="reference"))


def test_gradients_accumulate_and_buffers_are_reused_across_steps():
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 1, S)
    _, ref_grads = plain_loss_and_grads(model, ids, targets)
    engine = LayerMajorEngine(3, offload="full", kv_device_tokens=0, kv_chunk_tokens=8)
    engine.forward_backward(model, ids, targets)
    engine.forward_backward(model, ids, targets)
    doubled = {name: 2 * g for name, g in ref_grads.items()}
    assert max_relative_error(doubled, model)[0] < 1e-5


def test_bf16_autocast_matches_the_subsequence_engine():
    """Under bf16 autocast both orders run the same kernels in the same dtypes; they differ only in the order of
    fp32 sums, far below the bf16 error itself."""
    config = parity_config(True)
    ids, targets = make_batch(config, 2, S)
    state = GPT(config).state_dict()
    grads = []
    for engine in (SubsequenceEngine(3, "length"), LayerMajorEngine(3, recompute="selective")):
        model = GPT(config)
        model.load_state_dict(state)
        engine.forward_backward(
            model, ids, targets, forward_context=lambda: torch.autocast("cpu", dtype=torch.bfloat16)
        )
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    errors = [((a - grads[1][n]).norm() / a.norm()).item() for n, a in grads[0].items()]
    assert max(errors) < 2e-2


def test_evaluate_equals_the_plain_loss():
    config = parity_config(True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    ref_loss, _ = plain_loss_and_grads(model, ids, targets)
    total, count = LayerMajorEngine(4, kv_device_tokens=5, kv_chunk_tokens=6).evaluate(model, ids, targets)
    assert abs((total / count).item() - ref_loss.item()) < 1e-5
    assert all(p.grad is None for p in model.parameters())


def test_device_kv_bytes_are_bounded_by_a_chunk():
    """With every token's K/V on host, the device holds at a time two chunks' K/V (the one in use and the next one
    arriving) and one chunk's fp32 dK/dV: the bytes fall with the chunk size, while the subsequence order holds
    every layer's K/V and dK/dV for the whole sequence."""
    config = parity_config(n_layer=3)
    ids, targets = make_batch(config, 1, 48)
    per_token = 2 * config.n_query_groups * config.head_size * 4  # K and V, fp32: one layer, one row
    peaks = {}
    for chunks in (2, 4, 8):
        chunk = 48 // chunks
        engine = LayerMajorEngine(chunks, kv_device_tokens=0, kv_chunk_tokens=chunk)
        engine.forward_backward(GPT(config), ids, targets)
        peaks[chunks] = engine.meter.peak
        assert peaks[chunks] == 2 * chunk * per_token + chunk * per_token  # K/V of two chunks + dK/dV (fp32) of one
    assert peaks[2] > peaks[4] > peaks[8]
    subsequence = SubsequenceEngine(8)
    subsequence.forward_backward(GPT(config), ids, targets)
    assert subsequence.cache_peak_nbytes() >= 3 * 48 * per_token  # at least every layer's K/V of the whole sequence
    assert peaks[8] * 8 <= 3 * 48 * per_token


def test_negative_control_without_the_later_queries_shares_fails_parity(monkeypatch):
    """If the chunk-major loop skipped what later chunks' queries add (dK/dV of earlier chunks, their own dq),
    the parity check above would catch it."""
    config = parity_config()
    model = GPT(config)
    ids, targets = make_batch(config, 2, S)
    _, ref_grads = plain_loss_and_grads(model, ids, targets)
    monkeypatch.setattr(chunk_major, "prefix_block_backward", lambda *args: iter(()))
    LayerMajorEngine(3).forward_backward(model, ids, targets)
    assert max_relative_error(ref_grads, model)[0] > 1e-3


def test_settings_it_cannot_run_are_refused_by_name():
    with pytest.raises(ValueError, match="recompute must be one of"):
        LayerMajorEngine(2, recompute="none")
    with pytest.raises(ValueError, match="offload must be one of"):
        LayerMajorEngine(2, offload="adaptive")
    with pytest.raises(ValueError, match="num_subsequences must be a positive integer"):
        LayerMajorEngine(0)
    config = parity_config()
    model = apply_recompute(GPT(config), "full")
    ids, targets = make_batch(config, 1, 8)
    with pytest.raises(ValueError, match="without apply_recompute"):
        LayerMajorEngine(2).forward_backward(model, ids, targets)


@settings(max_examples=25, deadline=None)
@given(
    seq_len=st.integers(8, 60),
    num_chunks=st.integers(1, 6),
    device_tokens=st.one_of(st.none(), st.integers(0, 70)),
    chunk_tokens=st.integers(1, 20),
    batch=st.integers(1, 2),
    bf16=st.booleans(),
)
def test_measured_kv_bytes_equal_the_planners_count(seq_len, num_chunks, device_tokens, chunk_tokens, batch, bf16):
    """The engine's K/V + dK/dV peak, measured from the tensors it holds, is the planner's ``kv_peak_bytes``, for
    any chunking, device part and streamed chunk size (chunks straddling the device part included)."""
    if num_chunks > seq_len:
        return
    config = parity_config(True)
    ids, targets = make_batch(config, batch, seq_len)
    engine = LayerMajorEngine(num_chunks, kv_device_tokens=device_tokens, kv_chunk_tokens=chunk_tokens)
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else nullcontext
    engine.forward_backward(GPT(config), ids, targets, forward_context=context)
    dtypes = precision_bytes("bf16-mixed" if bf16 else "fp32")
    spans = engine.plan(ids, config).spans
    assert engine.meter.peak == kv_peak_bytes(config, dtypes, spans, device_tokens, chunk_tokens, batch)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_kept_bytes_equal_the_planners_count(recompute, bf16):
    """What the forward keeps per token and layer is ``kept_bytes_per_token``; with offload="full" every layer's
    but the last is on host."""
    config = parity_config(True, n_layer=3)
    ids, targets = make_batch(config, 2, S)
    engine = LayerMajorEngine(4, recompute=recompute, offload="full")
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else nullcontext
    engine.forward_backward(GPT(config), ids, targets, forward_context=context)
    per_token = kept_bytes_per_token(config, precision_bytes("bf16-mixed" if bf16 else "fp32"), recompute)
    assert engine.kept_nbytes() == 3 * 2 * S * per_token
    assert engine.kept_host_nbytes() >= 2 * 2 * S * per_token  # two of three layers (the pool rounds up slices)


# -- K/V on host: double-buffered, and bounded whatever the length --------------------------------------------


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_host_kv_chunks_are_double_buffered(recompute):
    """K/V beyond kv_device_tokens stream in while the previous chunk computes: in every streaming pass (the
    forward's prefix, the chunk-major backward's key chunks), chunk i + 1's copy is issued before the compute stream
    waits for chunk i. Copies land only when waited for (NaN until then), so the gradients also show every read
    waited for its copy."""
    config = parity_config(True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, 48)
    copies = streamed_kv.RecordingCopies()
    engine = LayerMajorEngine(4, recompute=recompute, kv_device_tokens=6, kv_chunk_tokens=5)
    with streamed_kv.tagged_passes(), streamed_kv.copies_through(copies):
        _check_parity(model, ids, targets, engine)
    assert copies.double_buffered() >= 20


def test_a_stale_prefetched_chunk_fails_parity():
    """Negative control for the streamed K/V: a copy that brings the previous host chunk breaks the gradients."""
    config = parity_config(True)
    model = GPT(config)
    ids, targets = make_batch(config, 2, 48)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    engine = LayerMajorEngine(4, kv_device_tokens=6, kv_chunk_tokens=5)
    with streamed_kv.copies_through(streamed_kv.StaleCopies()):
        loss = engine.forward_backward(model, ids, targets)
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() > 1e-4 or max_relative_error(ref_grads, model)[0] > 1e-3


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_device_kv_bytes_do_not_grow_with_the_sequence(recompute):
    """The memory bound: with kv_device_tokens set and chunks of a fixed length, the device's K/V and dK/dV bytes
    (``meter``) are the same at 48, 96 and 192 tokens; with all K/V on the device they grow with the sequence."""
    config = parity_config(True)
    peaks: dict[int | None, list[int]] = {12: [], None: []}
    for device_tokens in peaks:
        for seq_len in (48, 96, 192):
            ids, targets = make_batch(config, 1, seq_len)
            engine = LayerMajorEngine(
                seq_len // 12, recompute=recompute, kv_device_tokens=device_tokens, kv_chunk_tokens=6
            )
            engine.forward_backward(GPT(config), ids, targets)
            peaks[device_tokens].append(engine.meter.peak)
    assert len(set(peaks[12])) == 1, peaks
    assert peaks[None][0] < peaks[None][1] < peaks[None][2], peaks


# -- checkpoints from host: chunk by chunk as the layer above lets go of its own -----------------------------------


class _CheckpointCopies(DeferredCopies):
    """Deferred copies (a destination holds NaN until its copy is waited for) that log each host -> device copy and
    each wait for one, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int]] = []
        self._fetches: set[int] = set()

    def h2d(self, pairs):
        ticket = super().h2d(pairs)
        self._fetches.add(ticket.done)
        self.log.append(("issue", ticket.done))
        return ticket

    def wait(self, ticket):
        if ticket.done in self._fetches:
            self.log.append(("wait", ticket.done))
        super().wait(ticket)


def _checkpoint_copies(monkeypatch, copies: DeferredCopies) -> None:
    """Every engine's checkpoints copy through ``copies``."""
    monkeypatch.setattr(layer_major._Checkpoints, "engine", staticmethod(lambda device: copies))


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_checkpoints_come_back_one_copy_per_chunk_before_the_layer_reads_them(monkeypatch, recompute):
    """With offload="full", each chunk of a layer's checkpoints comes back in its own copy, all of them issued while
    the layer above runs its chunk-major loop, and each waited for only when this layer's replay reads it. Copies land
    only when waited for (NaN until then), so parity also shows no chunk is read before its copy."""
    config = parity_config(True, n_layer=3)
    model = GPT(config)
    ids, targets = make_batch(config, 2, 48)
    copies = _CheckpointCopies()
    _checkpoint_copies(monkeypatch, copies)
    _check_parity(model, ids, targets, LayerMajorEngine(4, recompute=recompute, offload="full"))
    layer = [("issue", None)] * 4 + [("wait", None)] * 4  # per host-resident layer: 4 copies, then 4 waits
    assert [(kind, None) for kind, _ in copies.log] == layer * 2, copies.log
    issued = [ticket for kind, ticket in copies.log if kind == "issue"]
    assert [ticket for kind, ticket in copies.log if kind == "wait"] == issued  # each chunk waits for its own copy


def test_a_stale_prefetched_checkpoint_chunk_fails_parity(monkeypatch):
    """Negative control for the chunk-by-chunk prefetch: a copy that brings the previous chunk's checkpoints (of the
    same shapes) breaks the gradients."""
    config = parity_config(True, n_layer=3)
    model = GPT(config)
    ids, targets = make_batch(config, 2, 48)
    ref_loss, ref_grads = plain_loss_and_grads(model, ids, targets)
    _checkpoint_copies(monkeypatch, streamed_kv.StaleCopies())
    LayerMajorEngine(4, offload="full").forward_backward(model, ids, targets)
    assert max_relative_error(ref_grads, model)[0] > 1e-3


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-mixed"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_the_device_holds_one_layer_of_checkpoints_and_a_chunk(monkeypatch, recompute, bf16):
    """The bound: with offload="full" the kept checkpoints on the device (the checkpoints' meter, by storage) peak at one
    layer's and one chunk's (``kept_bytes_per_token``); brought back a whole layer ahead, as before chunk-by-chunk
    prefetch (the negative control), they peak at two layers'."""
    config = parity_config(True, n_layer=3)
    ids, targets = make_batch(config, 2, 48)
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else nullcontext
    per_token = kept_bytes_per_token(config, precision_bytes("bf16-mixed" if bf16 else "fp32"), recompute)
    layer_bytes, chunk_bytes = 2 * 48 * per_token, 2 * 12 * per_token
    peaks, prefetch = [], layer_major._Checkpoints.prefetch
    for whole_layer in (False, True):
        if whole_layer:
            monkeypatch.setattr(layer_major._Checkpoints, "prefetch", lambda self, layer, chunk: prefetch(self, layer))
        engine = LayerMajorEngine(4, recompute=recompute, offload="full")
        engine.forward_backward(GPT(config), ids, targets, forward_context=context)
        peaks.append(engine._checkpoints.meter.peak)
        assert engine._checkpoints.meter.live == 0  # every chunk let go of by the step's end
    assert peaks == [layer_bytes + chunk_bytes, 2 * layer_bytes], peaks
