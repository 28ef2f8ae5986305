"""The plain model on packed documents: ``GPT.forward(ids, document_ids)`` equals every document run alone."""

from __future__ import annotations

import pytest
import torch

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.documents import Documents
from lightning_sppo.model.gpt import rope_cos_sin, rope_cos_sin_at
from tests.conftest import document_ids_from_lengths

LLAMA3 = dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=16)
TINY = dict(block_size=256, vocab_size=64, n_layer=2, n_embd=32, n_head=4, intermediate_size=48)
CONFIGS = {
    "llama": GPTConfig(**TINY, n_query_groups=2, rope_base=500000.0),
    "llama-rope-scaling": GPTConfig(**TINY, n_query_groups=2, rope_scaling=LLAMA3),
    "qwen3-yarn": GPTConfig(**TINY, n_query_groups=2, norm_qk=True, norm_eps=1e-6, rope_scaling=YARN),
    "qwen2.5": GPTConfig(**TINY, n_query_groups=1, attn_bias=True),
}
ROWS = [[9, 1, 17, 13], [1, 1, 38]]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_logits_equal_each_document_alone(name):
    model = GPT(CONFIGS[name])
    document_ids = document_ids_from_lengths(ROWS)
    ids = torch.randint(0, 64, document_ids.shape)
    packed = model(ids, document_ids)
    for row in range(ids.shape[0]):
        for doc in document_ids[row].unique_consecutive():
            cols = (document_ids[row] == doc).nonzero().flatten()
            torch.testing.assert_close(packed[row, cols], model(ids[row : row + 1, cols])[0], rtol=1e-5, atol=1e-5)
    # Negative control: the mask dropped, later documents see earlier ones (and their positions run on).
    assert not torch.allclose(model(ids)[0, 10:], packed[0, 10:], atol=1e-3)


def test_positions_restart_at_each_document():
    model = GPT(CONFIGS["llama-rope-scaling"])
    document_ids = document_ids_from_lengths([[20, 20]])
    ids = torch.randint(0, 64, (1, 40))
    documents = Documents.from_ids(document_ids)
    assert documents.positions(0, 40)[0].tolist() == list(range(20)) * 2
    assert documents.positions(18, 4)[0].tolist() == [18, 19, 0, 1]
    packed = model(ids, document_ids)
    alone = model(ids[:, 20:])
    torch.testing.assert_close(packed[:, 20:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scaling", [None, LLAMA3, YARN], ids=["plain", "llama3", "yarn"])
def test_rope_at_positions_equals_rope_at_an_offset(scaling):
    config = GPTConfig.from_name("tiny", rope_scaling=scaling)
    cos, sin = rope_cos_sin(config, 1000, 7, torch.device("cpu"))
    positions = torch.arange(1000, 1007).expand(2, 7)
    cos_at, sin_at = rope_cos_sin_at(config, positions)
    assert cos_at.shape == (2, 1, 7, config.rope_n_elem)
    assert torch.equal(cos_at[1, 0], cos) and torch.equal(sin_at[0, 0], sin)


def test_document_ids_with_an_offset_are_refused():
    model = GPT(CONFIGS["llama"])
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="offset must be 0"):
        model(ids, torch.zeros_like(ids), offset=4)
    with pytest.raises(TypeError, match="document_ids must be an integer tensor"):
        model(ids, 3)


def test_pieces_of_a_window():
    documents = Documents.from_ids(document_ids_from_lengths([[5, 1, 10, 4], [20]]))
    pieces = documents.window(4, 8)  # tokens 4..11
    assert pieces.bounds == ((0, 1, 2, 8), (0, 8))
    assert pieces.first_starts == (0, 0)
    assert pieces.split and pieces.max_length == 8 and pieces.num_pieces == 4
    assert pieces.prefix_groups() == [(slice(0, 1), 1, 0), (slice(1, 2), 8, 0)]
    assert pieces.cu_seqlens(torch.device("cpu")).tolist() == [0, 1, 2, 8, 16]
    assert pieces.segment_ids(torch.device("cpu")).tolist() == [[0, 1, 2, 2, 2, 2, 2, 2], [0] * 8]
    assert documents.window(4, 8) is pieces  # memoised: every layer shares it
    same = documents.window(6, 2)  # tokens 6, 7: one document per row; row 0's starts at 6, so it reads no prefix
    assert not same.split and same.first_starts == (6, 0) and same.prefix_groups() == [(slice(1, 2), 2, 0)]
    assert documents.key_counts()[:7].tolist() == [2, 4, 6, 8, 10, 7, 8]  # row 0: 1..5, 1, 1; row 1: 1..7
