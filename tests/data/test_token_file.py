"""Token files: round trip, dtype choice, and the errors of TokenFile.open."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from lightning_sppo.data import TokenFile, write_tokens
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


def test_open_names_the_first_id_outside_the_vocabulary(tmp_path):
    write_tokens(tmp_path / "t", [[1, 2, 3], [4, 5, 6]], vocab_size=256)
    sidecar = tmp_path / "t.json"
    sidecar.write_text(sidecar.read_text().replace('"vocab_size": 256', '"vocab_size": 5'))
    with pytest.raises(ValueError, match=r"Token id 5 at position 4 of .*t\.bin is outside the vocabulary \[0, 5\)"):
        TokenFile.open(tmp_path / "t")
    assert TokenFile.open(tmp_path / "t", check_ids=False).vocab_size == 5  # trusted files skip the scan


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
