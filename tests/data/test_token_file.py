"""Token files: round trip, dtype choice, and the errors of TokenFile.open."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from lightning_sppo.data import TokenDataModule, TokenFile, write_tokens
from lightning_sppo.data.token_file import dtype_for_vocab, token_file_paths

DOCS = [[1, 2, 3], [], [4, 5, 6, 7], [255]]


def test_round_trip(tmp_path):
    meta = write_tokens(tmp_path / "sub" / "corpus", DOCS, vocab_size=256, eos_id=0, tokenizer="bytes")
    assert (meta.num_tokens, meta.documents, meta.dtype, meta.eos_id) == (8, 4, "uint16", 0)
    for name in ("corpus", "corpus.bin", "corpus.json", "corpus.idx"):
        tf = TokenFile.open(tmp_path / "sub" / name)
        assert [tf.document(i).tolist() for i in range(len(tf))] == DOCS
        assert tf.document(-1).tolist() == [255]
    assert tf.ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 255]
    assert tf.offsets.tolist() == [0, 3, 3, 7, 8]
    sidecar = json.loads((tmp_path / "sub" / "corpus.json").read_text())
    expected = {"format": "lightning-sppo-tokens", "version": 1, "dtype": "uint16", "vocab_size": 256, "num_tokens": 8}
    assert expected.items() <= sidecar.items()
    assert (sidecar["documents"], sidecar["eos_id"], sidecar["tokenizer"]) == (4, 0, "bytes")
    assert not list((tmp_path / "sub").glob("*.tmp"))


def test_numpy_documents_and_empty_file(tmp_path):
    write_tokens(tmp_path / "a", (np.arange(n, dtype=np.int32) for n in (5, 0, 2)), vocab_size=10)
    assert TokenFile.open(tmp_path / "a").ids.tolist() == [0, 1, 2, 3, 4, 0, 1]
    write_tokens(tmp_path / "empty", [], vocab_size=10)
    empty = TokenFile.open(tmp_path / "empty")
    assert (empty.num_tokens, empty.num_documents, empty.ids.size) == (0, 0, 0)


@pytest.mark.parametrize(
    ("vocab_size", "dtype", "itemsize"),
    [(256, "uint16", 2), (2**16, "uint16", 2), (2**16 + 1, "uint32", 4), (152064, "uint32", 4)],
)
def test_dtype_choice(tmp_path, vocab_size, dtype, itemsize):
    assert dtype_for_vocab(vocab_size) == dtype
    top = vocab_size - 1
    meta = write_tokens(tmp_path / "t", [[0, top], [top]], vocab_size=vocab_size)
    assert meta.dtype == dtype
    assert (tmp_path / "t.bin").stat().st_size == 3 * itemsize
    assert TokenFile.open(tmp_path / "t").ids.tolist() == [0, top, top]


def test_write_rejects_ids_outside_the_vocabulary(tmp_path):
    with pytest.raises(
        ValueError, match=r"Token id 300 at position 2 of document 1 is outside the vocabulary \[0, 256\)"
    ):
        write_tokens(tmp_path / "bad", [[1], [1, 2, 300, 400]], vocab_size=256)
    with pytest.raises(ValueError, match="Token id -1 at position 0 of document 0"):
        write_tokens(tmp_path / "bad", [[-1]], vocab_size=256)
    assert not list(tmp_path.iterdir())  # nothing left behind, not even temporaries
    with pytest.raises(ValueError, match="eos_id=256"):
        write_tokens(tmp_path / "bad", [[1]], vocab_size=256, eos_id=256)
    with pytest.raises(ValueError, match="vocab_size must be an integer"):
        write_tokens(tmp_path / "bad", [[1]], vocab_size=0)


def test_open_checks_the_recorded_max_id_and_verify_reads_every_id(tmp_path):
    meta = write_tokens(tmp_path / "t", [[1, 2, 3], [4, 5, 6]], vocab_size=256)
    assert meta.max_id == 6 and json.loads((tmp_path / "t.json").read_text())["max_id"] == 6
    assert TokenFile.open(tmp_path / "t").verify() == 6
    sidecar = tmp_path / "t.json"
    sidecar.write_text(sidecar.read_text().replace('"vocab_size": 256', '"vocab_size": 5'))
    with pytest.raises(ValueError, match=r"t\.json records max_id=6, outside the vocabulary \[0, 5\)"):
        TokenFile.open(tmp_path / "t")
    trusted = TokenFile.open(tmp_path / "t", check_ids=False)  # trusted files skip even that check
    with pytest.raises(ValueError, match=r"Token id 5 at position 4 of .*t\.bin is outside the vocabulary \[0, 5\)"):
        trusted.verify()


def test_verify_catches_ids_that_changed_after_writing(tmp_path):
    write_tokens(tmp_path / "t", [[1, 2, 3]], vocab_size=256)
    (tmp_path / "t.bin").write_bytes(np.array([1, 2, 9], dtype="<u2").tobytes())  # same size, new ids
    token_file = TokenFile.open(tmp_path / "t")  # what open checks (sizes, max_id) still holds
    with pytest.raises(ValueError, match=r"records max_id=3, but the largest id in .*t\.bin is 9"):
        token_file.verify()


def test_open_reads_no_id_when_max_id_is_recorded(tmp_path, monkeypatch):
    write_tokens(tmp_path / "t", [list(range(100))] * 3, vocab_size=256)
    reads = []
    monkeypatch.setattr(np, "memmap", lambda *args, **kwargs: reads.append(args))
    TokenFile.open(tmp_path / "t")
    assert reads == []


def test_training_start_up_checks_the_recorded_max_id_without_reading_ids(tmp_path, monkeypatch):
    """What every rank does at start-up (TokenDataModule.setup) trusts the sidecar's max_id: no id is read."""
    write_tokens(tmp_path / "t", [list(range(60))] * 4, vocab_size=256)
    reads = []
    monkeypatch.setattr(np, "memmap", lambda *args, **kwargs: reads.append(args))
    monkeypatch.setattr(TokenFile, "verify", lambda self: reads.append("verify"))
    data = TokenDataModule(tmp_path / "t", seq_len=8, batch_size=2)
    data.setup("fit")
    assert len(data.train_dataset) > 0 and reads == []
    sidecar = tmp_path / "t.json"
    sidecar.write_text(sidecar.read_text().replace('"max_id": 59', '"max_id": 256'))  # the check is of this number
    with pytest.raises(ValueError, match=r"records max_id=256, outside the vocabulary \[0, 256\)"):
        TokenDataModule(tmp_path / "t", seq_len=8, batch_size=2).setup("fit")
    assert reads == []


def test_a_sidecar_without_max_id_gets_the_full_read_and_a_warning(tmp_path):
    write_tokens(tmp_path / "t", [[1, 2, 3], [4, 5, 6]], vocab_size=256)
    raw = json.loads((tmp_path / "t.json").read_text())
    del raw["max_id"]  # as written before max_id was recorded
    raw["vocab_size"] = 5
    (tmp_path / "t.json").write_text(json.dumps(raw))
    with (
        pytest.warns(UserWarning, match=r"does not record max_id.*sppo-prepare --verify"),
        pytest.raises(ValueError, match=r"Token id 5 at position 4"),
    ):
        TokenFile.open(tmp_path / "t")


def test_max_id_must_fit_the_token_count(tmp_path):
    write_tokens(tmp_path / "empty", [[]], vocab_size=256)
    assert TokenFile.open(tmp_path / "empty").meta.max_id is None
    sidecar = tmp_path / "empty.json"
    sidecar.write_text(sidecar.read_text().replace('"max_id": null', '"max_id": 3'))
    with pytest.raises(ValueError, match=r"max_id=3 with num_tokens=0"):
        TokenFile.open(tmp_path / "empty")


def test_missing_file_says_to_run_sppo_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.json.*sppo-prepare"):
        TokenFile.open(tmp_path / "nope")
    write_tokens(tmp_path / "t", [[1]], vocab_size=256)
    (tmp_path / "t.idx").unlink()
    with pytest.raises(FileNotFoundError, match=r"t\.idx"):
        TokenFile.open(tmp_path / "t")


def test_open_rejects_inconsistent_parts(tmp_path):
    write_tokens(tmp_path / "t", [[1, 2], [3]], vocab_size=256)
    bin_path, idx_path, json_path = token_file_paths(tmp_path / "t")
    good_json = json_path.read_text()

    json_path.write_text(good_json.replace('"num_tokens": 3', '"num_tokens": 4'))
    with pytest.raises(ValueError, match="truncated or stale"):
        TokenFile.open(tmp_path / "t")
    json_path.write_text(good_json.replace('"documents": 2', '"documents": 3'))
    with pytest.raises(ValueError, match=r"t\.idx does not match the sidecar"):
        TokenFile.open(tmp_path / "t")
    json_path.write_text(good_json.replace('"uint16"', '"uint32"'))
    with pytest.raises(ValueError, match="vocab_size=256 needs 'uint16'"):
        TokenFile.open(tmp_path / "t")
    json_path.write_text(good_json.replace('"version": 1', '"version": 9'))
    with pytest.raises(ValueError, match="version=9"):
        TokenFile.open(tmp_path / "t")
    json_path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        TokenFile.open(tmp_path / "t")


def test_pickle_maps_the_file_again_instead_of_copying_it(tmp_path):
    write_tokens(tmp_path / "t", [list(range(200))] * 50, vocab_size=256)
    tf = TokenFile.open(tmp_path / "t")
    _ = tf.ids  # mapped
    payload = pickle.dumps(tf)
    assert len(payload) < tf.num_tokens  # ids not included (they are 20 KB)
    copy = pickle.loads(payload)
    assert np.array_equal(copy.ids, tf.ids)
    assert isinstance(copy.ids, np.memmap)
