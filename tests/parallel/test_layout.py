"""Layout checks that must fail before any communication, and the stage split."""

import pytest
import torch
from lightning.fabric import Fabric

from lightning_sppo import GPT, GPTConfig, SPPOStrategy
from lightning_sppo.parallel import ParallelDims, layers_per_stage, split_stage
from lightning_sppo.parallel.stages import stage_costs


def test_dims_take_data_parallel_from_the_rest_of_the_world():
    assert ParallelDims.from_world(8, pipeline_parallel=2, sequence_parallel=2) == ParallelDims(2, 2, 2)
    assert ParallelDims(2, 2, 2).coordinates(5) == (1, 0, 1)


def test_layout_that_does_not_divide_the_world_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"pipeline_parallel \* sequence_parallel = 3 \* 1 must divide.*valid"):
        Fabric(strategy=SPPOStrategy(pipeline_parallel=3), accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match="sequence_parallel=0"):
        SPPOStrategy(sequence_parallel=0)


@pytest.mark.parametrize(
    ("config", "sp", "pp", "match"),
    [
        (dict(n_head=4, n_query_groups=1), 2, 1, r"n_query_groups=1 must both divide by sequence_parallel=2.*\[1\]"),
        (dict(n_head=6, n_embd=48), 4, 1, "n_head=6"),
        (dict(n_layer=2), 1, 4, r"n_layer=2 layers, fewer than pipeline_parallel=4.*4 processes.*: \[1, 2\]"),
    ],
)
def test_model_that_does_not_fit_the_layout_names_the_setting(config, sp, pp, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(pp, 1, sp).check_model(GPTConfig(**config))


@pytest.mark.parametrize(
    ("world", "pp", "sp", "config", "without_model", "with_model"),
    [  # issue 39: 3 processes and pp=2 advised pp=3, which a 2-layer model cannot run
        (3, 2, 1, dict(n_layer=2), "[1, 3]", "valid pipeline_parallel values (the model has 2 layers): [1]."),
        (4, 1, 3, dict(n_head=4, n_query_groups=1), "[1, 2, 4]", "valid sequence_parallel values (n_head=4,"
         " n_query_groups=1): [1]."),
        (4, 3, 2, dict(n_layer=2), "[1, 2]", "with sequence_parallel=2, valid pipeline_parallel values (the model has"
         " 2 layers): [1, 2]"),
    ],
)  # fmt: skip
def test_suggested_sizes_fit_the_model_and_the_world(world, pp, sp, config, without_model, with_model):
    """Every value the error suggests runs: ``from_world`` accepts it, model included (the old advice did not)."""
    config = GPTConfig(**({"n_head": 4} | config))
    with pytest.raises(ValueError) as unknown:
        ParallelDims.from_world(world, pp, sp)
    assert without_model in str(unknown.value)
    with pytest.raises(ValueError) as known:
        ParallelDims.from_world(world, pp, sp, config)
    message = str(known.value)
    assert with_model in message, message
    named = "pipeline_parallel" if "valid pipeline_parallel" in message else "sequence_parallel"
    values = [int(v) for v in message.rsplit("[", 1)[1].split("]")[0].split(",")]
    for value in values:  # the advice, followed
        sizes = {"pipeline_parallel": pp, "sequence_parallel": sp} | {named: value}
        ParallelDims.from_world(world, sizes["pipeline_parallel"], sizes["sequence_parallel"], config)


def test_stages_balance_compute_and_cover_every_layer():
    config = GPTConfig.from_name("gpt-7b")
    counts = layers_per_stage(config, 4)
    assert sum(counts) == 32 and len(counts) == 4 and min(counts) >= 1
    block, _, head = stage_costs(config)
    costs = [n * block for n in counts]
    costs[-1] += head
    assert max(costs) <= min(costs) + 2 * block  # balanced to within a couple of layers
    assert counts[-1] <= counts[0]  # the head weighs on the last stage


def test_small_vocabulary_models_split_evenly():
    assert layers_per_stage(GPTConfig(n_layer=8, vocab_size=16), 4) == [2, 2, 2, 2]


def test_explicit_layers_per_stage_is_checked():
    config = GPTConfig(n_layer=4)
    assert layers_per_stage(config, 2, [1, 3]) == [1, 3]
    with pytest.raises(ValueError, match=r"layers_per_stage=\[1, 2\] must list 2 positive layer counts"):
        layers_per_stage(config, 2, [1, 2])


def test_split_stage_keeps_the_plain_model_names():
    config = GPTConfig(n_layer=4, vocab_size=32)
    full = set(GPT(config).state_dict())
    stages = [split_stage(GPT(config), k, [1, 2, 1]) for k in range(3)]
    keys = [set(stage.state_dict()) for stage in stages]
    assert set().union(*keys) == full and sum(map(len, keys)) == len(full)
    assert stages[0].wte is not None and stages[0].lm_head is None
    assert stages[2].wte is None and stages[2].lm_head is not None
    assert list(stages[1].blocks) == ["1", "2"]
    hidden = torch.randn(1, 5, config.n_embd)
    assert stages[1].hidden_states(hidden).shape == hidden.shape  # middle stages take hidden states
