import pytest
import torch

from lightning_sppo import GPT, GPTConfig


@pytest.mark.parametrize(
    ("name", "layers", "hidden", "heads"),
    [("gpt-7b", 32, 4096, 32), ("gpt-13b", 40, 5120, 40), ("gpt-65b", 80, 8192, 64)],
)
def test_paper_sizes(name, layers, hidden, heads):
    config = GPTConfig.from_name(name)
    assert (config.n_layer, config.n_embd, config.n_head) == (layers, hidden, heads)
    assert config.n_query_groups == heads and config.head_size == 128


def test_gpt7b_parameter_count_is_about_7b():
    assert 6.5e9 < GPTConfig.from_name("gpt-7b").num_parameters() < 7.0e9


@pytest.mark.parametrize("name", ["tiny", "tiny-gqa", "tiny-gelu", "small"])
def test_num_parameters_matches_the_model(name):
    config = GPTConfig.from_name(name)
    assert config.num_parameters() == sum(p.numel() for p in GPT(config).parameters())


def test_from_name_overrides_and_unknown_name():
    assert GPTConfig.from_name("tiny", n_layer=3).n_layer == 3
    with pytest.raises(ValueError, match="Unknown model name='gpt-8b'.*gpt-7b"):
        GPTConfig.from_name("gpt-8b")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(n_head=4, n_query_groups=3), "n_query_groups"),
        (dict(n_embd=30, n_head=4), "head_size"),
        (dict(n_layer=0), "n_layer"),
        (dict(mlp="relu"), "mlp"),
        (dict(norm="batchnorm"), "norm"),
        (dict(rotary_percentage=1.5), "rotary_percentage"),
    ],
)
def test_bad_config_names_the_setting(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


SWITCHES = [
    dict(tie_embeddings=True),
    dict(attn_bias=True),
    dict(norm_qk=True),
    dict(norm_qk=True, norm="layernorm", bias=True),
    dict(bias=True, attn_bias=True, tie_embeddings=True),
    dict(norm="layernorm", bias=False),
]


@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_num_parameters_matches_the_model_for_every_switch(switches):
    config = GPTConfig(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=64, **switches)
    model = GPT(config)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    head = config.vocab_size * config.n_embd
    assert config.num_matmul_parameters() == config.num_parameters() - head * (not config.tie_embeddings)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-7b", "qwen3-8b"])
def test_open_model_presets_count_like_the_built_model(name):
    config = GPTConfig.from_name(name)
    with torch.device("meta"):  # no memory: only shapes
        model = GPT(config)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    assert config.n_head * config.head_size in (config.n_embd, 4096)  # Qwen3-8B: 32 x 128 over 4096


def test_open_model_presets_have_the_upstream_parameter_counts():
    """Model cards: Llama 3.2 1B has 1.24B parameters, 3B 3.21B, Llama 3.1 8B 8.03B, Qwen2.5-7B 7.61B,
    Qwen3-8B 8.2B (tied embeddings counted once)."""
    expected = {"llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21, "llama-3.1-8b": 8.03, "qwen2.5-7b": 7.61, "qwen3-8b": 8.19}
    for name, billions in expected.items():
        assert GPTConfig.from_name(name).num_parameters() / 1e9 == pytest.approx(billions, rel=0.005), name


def test_to_dict_round_trips_through_from_dict_with_rope_scaling():
    config = GPTConfig.from_name("llama-3.1-8b")
    data = config.to_dict()
    assert data["rope_scaling"]["type"] == "llama3"  # plain dict: JSON- and checkpoint-friendly
    assert GPTConfig.from_dict(data) == config
    with pytest.raises(ValueError, match=r"Unknown GPTConfig fields \['n_embed'\]"):
        GPTConfig.from_dict(data | {"n_embed": 1})


@pytest.mark.parametrize(
    ("scaling", "match"),
    [
        (dict(type="linear", factor=2.0, original_max_position_embeddings=8), "rope_scaling.type"),
        (dict(type="llama3", factor=0.0, original_max_position_embeddings=8), "rope_scaling.factor"),
        (dict(type="llama3", factor=8.0, original_max_position_embeddings=0), "original_max_position_embeddings"),
        (dict(type="llama3", factor=8.0, original_max_position_embeddings=8, low_freq_factor=4.0), "low_freq_factor"),
        (dict(type="yarn", factor=4.0, original_max_position_embeddings=8, beta_slow=64.0), "beta_slow"),
        (dict(type="yarn", factor=4.0, original_max_position_embeddings=8, attention_factor=-1.0), "attention_factor"),
        (dict(type="yarn", factor=4.0, original_max_position_embeddings=8, scale=1.0), "scale"),
    ],
)
def test_bad_rope_scaling_names_the_field(scaling, match):
    with pytest.raises((ValueError, TypeError), match=match):
        GPTConfig(rope_scaling=scaling)


@pytest.mark.parametrize(("key", "value"), [("tie_embeddings", 1), ("norm_qk", "yes"), ("rope_base", 1.0)])
def test_bad_switch_names_the_field(key, value):
    with pytest.raises(ValueError, match=f"GPTConfig.{key}"):
        GPTConfig(**{key: value})
