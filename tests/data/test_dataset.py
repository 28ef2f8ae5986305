"""PackedSequences: document boundaries, packing, target shift and padding, determinism."""

from __future__ import annotations

import pytest
import torch

from lightning_sppo.data import PackedSequences, TokenFile, write_tokens
from lightning_sppo.loss import IGNORE_INDEX

EOS = 999
# Document k holds ids in [100 k, 100 k + length): the range tells which document an id came from.
LENGTHS = [1, 5, 8, 9, 23, 40, 2, 0, 17]
DOCS = [list(range(100 * k, 100 * k + n)) for k, n in enumerate(LENGTHS)]


@pytest.fixture(params=[None, EOS], ids=["no-eos", "eos"])
def token_file(request, tmp_path) -> TokenFile:
    write_tokens(tmp_path / "docs", DOCS, vocab_size=1000, eos_id=request.param)
    return TokenFile.open(tmp_path / "docs")


def _stream(order, eos_id):
    out = []
    for k in order:
        out += DOCS[k] + ([eos_id] if eos_id is not None else [])
    return out


@pytest.mark.parametrize("seq_len", [1, 4, 8, 16])
def test_unpacked_samples_never_mix_documents(token_file, seq_len):
    ds = PackedSequences(token_file, seq_len, packing=False, seed=3)
    assert not ds.packing and "one document per sample" in repr(ds)
    pairs = set()
    for i in range(len(ds)):
        sample = ds[i]
        ids, targets = sample["input_ids"], sample["targets"]
        assert ids.shape == targets.shape == (seq_len,) and ids.dtype == targets.dtype == torch.long
        valid = targets != IGNORE_INDEX
        n = int(valid.sum())
        assert valid[:n].all() and not valid[n:].any(), "padding only at the tail"
        assert (ids[n:] == ds.pad_id).all()
        real = [t for t in ids[:n].tolist() + targets[:n].tolist() if t != EOS]
        assert len({t // 100 for t in real}) == 1, f"sample {i} mixes documents: {ids}, {targets}"
        assert ids[1:n].tolist() == targets[: n - 1].tolist(), "targets are the next ids"
        pairs |= {(a, b) for a, b in zip(ids[:n].tolist(), targets[:n].tolist(), strict=True)}
    # Every next-token pair of every document (including "last token -> eos") is a target once.
    expected = set()
    for doc in DOCS:
        doc = doc + ([token_file.eos_id] if token_file.eos_id is not None else [])
        expected |= set(zip(doc[:-1], doc[1:], strict=True))
    assert pairs == expected
    total_pairs = sum(max(n + (token_file.eos_id is not None) - 1, 0) for n in LENGTHS)
    assert sum(int((ds[i]["targets"] != IGNORE_INDEX).sum()) for i in range(len(ds))) == total_pairs


def test_short_tail_is_padded_with_eos_or_zero(token_file):
    ds = PackedSequences(token_file, seq_len=8, packing=False, seed=None)
    # Document 1 is [100..104] (+ eos): one window with 4 (or 5) real pairs.
    sample = ds[0]  # document 0 has a single token (no pair) unless eos follows it
    if token_file.eos_id is None:
        assert sample["input_ids"].tolist() == [100, 101, 102, 103, 0, 0, 0, 0]
        assert sample["targets"].tolist() == [101, 102, 103, 104] + [IGNORE_INDEX] * 4
    else:
        assert sample["input_ids"].tolist() == [0] + [EOS] * 7
        assert sample["targets"].tolist() == [EOS] + [IGNORE_INDEX] * 7
        sample = ds[1]
        assert sample["input_ids"].tolist() == [100, 101, 102, 103, 104, EOS, EOS, EOS]
        assert sample["targets"].tolist() == [101, 102, 103, 104, EOS] + [IGNORE_INDEX] * 3


@pytest.mark.parametrize("seq_len", [1, 4, 7, 16])
def test_packing_fills_windows_from_the_concatenated_stream(token_file, seq_len):
    ds = PackedSequences(token_file, seq_len, packing=True, seed=None, document_mask=False)
    assert ds.packing and "packing=True (documents concatenated" in repr(ds)
    assert "attending across boundaries" in repr(ds) and "document_ids" not in ds[0]
    assert ("separated by eos_id=999" in repr(ds)) == (token_file.eos_id is not None)
    stream = _stream(range(len(DOCS)), token_file.eos_id)
    assert len(ds) == (len(stream) - 1) // seq_len
    for i in range(len(ds)):
        sample = ds[i]
        assert (sample["targets"] != IGNORE_INDEX).all(), "packed windows are full"
        assert sample["input_ids"].tolist() == stream[i * seq_len : (i + 1) * seq_len]
        assert sample["targets"].tolist() == stream[i * seq_len + 1 : (i + 1) * seq_len + 1]


def _stream_documents(order, eos_id):
    """The stream's document index of every position (a document's eos belongs to it)."""
    out = []
    for index, k in enumerate(order):
        out += [index] * (len(DOCS[k]) + (eos_id is not None))
    return out


@pytest.mark.parametrize("seq_len", [1, 4, 7, 16])
def test_document_mask_gives_document_ids_and_ignores_targets_across_documents(token_file, seq_len):
    ds = PackedSequences(token_file, seq_len, packing=True, seed=None)  # document_mask=True by default
    assert ds.document_mask and "each attending only to itself" in repr(ds)
    stream = _stream(range(len(DOCS)), token_file.eos_id)
    documents = _stream_documents(range(len(DOCS)), token_file.eos_id)
    pairs = set()
    for i in range(len(ds)):
        sample = ds[i]
        lo, hi = i * seq_len, (i + 1) * seq_len
        ids, targets, document_ids = sample["input_ids"], sample["targets"], sample["document_ids"]
        assert document_ids.shape == (seq_len,) and document_ids.dtype == torch.long
        assert ids.tolist() == stream[lo:hi]
        assert document_ids.tolist() == [d - documents[lo] for d in documents[lo:hi]]  # 0 first, eos in its document
        for t in range(seq_len):
            crosses = documents[lo + t + 1] != documents[lo + t]
            assert targets[t].item() == (IGNORE_INDEX if crosses else stream[lo + t + 1]), (i, t)
        pairs |= {(a, b) for a, b in zip(ids.tolist(), targets.tolist(), strict=True) if b != IGNORE_INDEX}
    # No target ever crosses into another document; "last id -> eos" is still learned.
    assert all(a // 100 == b // 100 or EOS in (a, b) for a, b in pairs), pairs
    if token_file.eos_id is not None:
        assert (104, EOS) in pairs and not any(a == EOS for a, _ in pairs)


def test_document_mask_needs_packing(token_file):
    ds = PackedSequences(token_file, 4, packing=False, document_mask=True)
    assert not ds.document_mask and set(ds[0]) == {"input_ids", "targets"}


def test_seed_orders_documents_deterministically(token_file):
    a = PackedSequences(token_file, 6, packing=True, seed=1)
    b = PackedSequences(token_file, 6, packing=True, seed=1)
    c = PackedSequences(token_file, 6, packing=True, seed=2)
    first = [a[i]["input_ids"].tolist() for i in range(len(a))]
    assert first == [b[i]["input_ids"].tolist() for i in range(len(b))]
    assert first != [c[i]["input_ids"].tolist() for i in range(len(c))]
    assert a[-1]["input_ids"].tolist() == first[-1]
    with pytest.raises(IndexError, match="out of range"):
        a[len(a)]


def test_errors_name_the_setting(tmp_path):
    write_tokens(tmp_path / "t", [[1, 2, 3], [4]], vocab_size=256)
    with pytest.raises(ValueError, match="seq_len=0"):
        PackedSequences(str(tmp_path / "t"), 0)
    with pytest.raises(ValueError, match=r"no sample of seq_len=4 with packing=True: it has 4 tokens"):
        PackedSequences(str(tmp_path / "t"), 4, packing=True)
    assert len(PackedSequences(str(tmp_path / "t"), 3, packing=True)) == 1
    write_tokens(tmp_path / "u", [[1], [2]], vocab_size=256)
    with pytest.raises(ValueError, match="every document has < 2 tokens"):
        PackedSequences(str(tmp_path / "u"), 4)
