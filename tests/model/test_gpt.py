import math

import pytest
import torch

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.model.gpt import apply_rope, rope_cos_sin, rope_frequencies


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


LLAMA3 = dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=64)


@pytest.mark.parametrize("scaling", [LLAMA3, YARN], ids=["llama3", "yarn"])
def test_scaled_rope_of_an_offset_window_equals_the_full_sequence(scaling):
    config = GPTConfig.from_name("tiny", rope_scaling=scaling)
    cos, sin = rope_cos_sin(config, 0, 300, torch.device("cpu"))
    cos_w, sin_w = rope_cos_sin(config, 211, 77, torch.device("cpu"))
    assert torch.equal(cos[211:288], cos_w) and torch.equal(sin[211:288], sin_w)


def test_llama3_scaling_keeps_high_frequencies_and_divides_low_ones():
    config = GPTConfig.from_name("tiny", rope_scaling=LLAMA3)
    plain, _ = rope_frequencies(GPTConfig.from_name("tiny"))
    scaled, factor = rope_frequencies(config)
    wavelength = 2 * torch.pi / plain
    short, long = wavelength < 64 / 4, wavelength > 64 / 1
    assert short.any() and long.any() and factor == 1.0
    assert torch.equal(scaled[short], plain[short])
    assert torch.allclose(scaled[long], plain[long] / 8, rtol=1e-15)
    middle = ~short & ~long
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()


def test_yarn_ramps_from_kept_to_interpolated_and_scales_cos_sin():
    config = GPTConfig.from_name("tiny", rope_scaling=YARN)
    plain, _ = rope_frequencies(GPTConfig.from_name("tiny"))
    scaled, factor = rope_frequencies(config)
    assert scaled[0] == plain[0] and torch.allclose(scaled[-1], plain[-1] / 4, rtol=1e-15)
    assert factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    cos, sin = rope_cos_sin(config, 0, 5, torch.device("cpu"))
    assert torch.allclose(cos**2 + sin**2, torch.full_like(cos, factor**2))


def test_tied_head_is_the_embedding_and_stays_tied_when_materialised():
    config = GPTConfig.from_name("tiny", tie_embeddings=True)
    model = GPT(config)
    assert model.lm_head.weight is model.wte.weight
    assert set(model.state_dict()) >= {"wte.weight", "lm_head.weight"}  # both keys, as in the plain checkpoint
    with torch.device("meta"):
        lazy = GPT(config)
    lazy.to_empty(device="cpu")  # nn.Module.to_empty alone would allocate two separate tensors
    assert lazy.lm_head.weight is lazy.wte.weight


def test_qk_norm_normalises_each_head_before_rope():
    """A norm_q weight of zeros makes every query zero, so attention is uniform over the causal prefix."""
    config = GPTConfig.from_name("tiny", norm_qk=True)
    model = GPT(config)
    attn = model.blocks["0"].attn
    assert attn.norm_q.weight.shape == (config.head_size,)
    seen = {}
    attn.core.register_forward_hook(lambda m, args, out: seen.update(q=args[0]))
    with torch.no_grad():
        attn.norm_q.weight.zero_()
        model(torch.randint(0, 256, (1, 6)))
    assert torch.count_nonzero(seen["q"]) == 0
