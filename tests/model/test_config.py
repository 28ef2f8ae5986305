import pytest

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
