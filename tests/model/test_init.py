"""Initial weights by seed and parameter name (``lightning_sppo.model.init``): a pipeline stage built on the meta
device and materialised alone holds exactly the plain model's weights, tied embeddings included; the old
initialisation (draws one after another from the global generator) is the negative control."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.model.init import parameter_seed, plain_name
from lightning_sppo.parallel.parallelize import materialize
from lightning_sppo.parallel.stages import layers_per_stage, split_stage
from tests.conftest import old_reset_parameters

CONFIG = GPTConfig.from_name("tiny-gqa", n_layer=4)


def _plain(config: GPTConfig, seed: int = 7) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return GPT(config).state_dict()


def _stage(config: GPTConfig, pp: int, stage: int, seed: int = 7) -> GPT:
    """Stage ``stage`` of ``pp``, cut on the meta device and then materialised, as the strategy builds it."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPT(config)
    split_stage(model, stage, layers_per_stage(config, pp))
    return materialize(model, torch.device("cpu"))


def _mismatches(stage: GPT, plain: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, value in stage.state_dict().items() if not torch.equal(value, plain[name])]


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_every_stage_built_alone_holds_the_plain_model_s_weights(pp: int, tied: bool):
    config = GPTConfig.from_name("tiny-gqa", n_layer=4, tie_embeddings=tied)
    plain = _plain(config)
    seen: set[str] = set()
    for stage in range(pp):
        built = _stage(config, pp, stage)
        assert not _mismatches(built, plain), (pp, stage)
        seen |= set(built.state_dict())
    assert seen == set(plain)  # the stages together hold every weight (a tied head on the last stage too)


def test_the_old_initialisation_gives_a_stage_other_weights(monkeypatch):
    """The negative control: what the comparison above catches. Drawn one after another, the second stage's first
    layer took the numbers the plain model's embedding took."""
    plain = _plain(CONFIG)
    monkeypatch.setattr(GPT, "reset_parameters", old_reset_parameters)
    second = _stage(CONFIG, 2, 1)
    assert _mismatches(second, plain)


def test_gpt_under_manual_seed_is_deterministic_and_the_seed_matters():
    first, again, other = _plain(CONFIG, 0), _plain(CONFIG, 0), _plain(CONFIG, 1)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["wte.weight"], other["wte.weight"])
    torch.manual_seed(0)
    a, b = GPT(CONFIG), GPT(CONFIG)  # two models after one seed: two seeds, two models
    assert a.init_seed != b.init_seed and not torch.equal(a.wte.weight, b.wte.weight)


def test_the_gpt_2_scheme_holds():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("small"))
    std = 0.02 / math.sqrt(2 * model.config.n_layer)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.blocks["1"].mlp.proj.weight.std().item() == pytest.approx(std, rel=0.02)
    assert torch.equal(model.norm_f.weight, torch.ones_like(model.norm_f.weight))
    # no two parameters of one shape share their draws
    fc_1, fc_2 = model.blocks["0"].mlp.fc_1.weight, model.blocks["0"].mlp.fc_2.weight
    assert not torch.equal(fc_1, fc_2)


def test_names_and_seeds_are_stable():
    """The hash is fixed (Python's ``hash`` is salted per process), and wrapper segments do not change a name."""
    assert parameter_seed(1337, "wte.weight") == parameter_seed(1337, "wte.weight")
    assert parameter_seed(1337, "wte.weight") != parameter_seed(1338, "wte.weight")
    assert 0 <= parameter_seed(1337, "blocks.0.attn.qkv.weight") < 2**63
    assert plain_name("blocks.0._checkpoint_wrapped_module.attn.qkv.weight", False) == "blocks.0.attn.qkv.weight"
    assert plain_name("lm_head.weight", True) == "wte.weight"
    assert plain_name("lm_head.weight", False) == "lm_head.weight"
