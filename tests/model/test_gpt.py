import pytest
import torch

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.model.gpt import apply_rope, rope_cos_sin


def test_plain_forward_returns_logits():
    model = GPT(GPTConfig.from_name("tiny-gqa"))
    assert model(torch.randint(0, 256, (2, 11))).shape == (2, 11, 256)


def test_rope_of_an_offset_window_equals_the_same_rows_of_the_full_sequence():
    config = GPTConfig.from_name("tiny-gelu")  # partial rotary
    cos, sin = rope_cos_sin(config, 0, 40, torch.device("cpu"))
    cos_w, sin_w = rope_cos_sin(config, 17, 9, torch.device("cpu"))
    assert torch.equal(cos[17:26], cos_w) and torch.equal(sin[17:26], sin_w)


def test_rope_is_a_relative_rotation():
    """q_m . k_n depends only on m - n: the property that makes offsets matter."""
    config = GPTConfig.from_name("tiny")
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def dot(m: int, n: int) -> float:
        cm, sm = rope_cos_sin(config, m, 1, torch.device("cpu"))
        cn, sn = rope_cos_sin(config, n, 1, torch.device("cpu"))
        qm = apply_rope(q, cm.double(), sm.double())
        kn = apply_rope(k, cn.double(), sn.double())
        return (qm * kn).sum().item()

    assert dot(5, 2) == pytest.approx(dot(1005, 1002), rel=1e-6)
    assert dot(5, 2) != pytest.approx(dot(6, 2), rel=1e-3)


def test_sequence_longer_than_block_size_names_the_setting():
    model = GPT(GPTConfig.from_name("tiny", block_size=8))
    with pytest.raises(ValueError, match="block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_plain_attention_refuses_an_offset():
    model = GPT(GPTConfig.from_name("tiny"))
    with pytest.raises(ValueError, match="offset must be 0"):
        model(torch.zeros(1, 4, dtype=torch.long), offset=4)
