"""Every shipped YAML parses against the entry points, and its model builds on the meta device."""

from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser

from lightning_sppo import GPT, SPPOTrainerStrategy
from lightning_sppo.data import TokenDataModule
from lightning_sppo.parallel import ParallelDims, layers_per_stage
from lightning_sppo.training import GPTPretraining

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
CLI_CONFIGS = [c for c in CONFIGS if not c.name.startswith("fabric-")]


def _parser() -> ArgumentParser:
    """The `sppo fit` groups: model and data classes, the trainer's strategy; the rest passes through."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--seed_everything", type=int)
    parser.add_class_arguments(GPTPretraining, "model")
    parser.add_class_arguments(TokenDataModule, "data")
    parser.add_argument("--trainer.strategy", type=SPPOTrainerStrategy)
    parser.add_argument("--trainer", type=dict)  # Lightning's own Trainer options: checked by the e2e test
    return parser


def test_all_configs_are_found():
    assert {"demo-cpu", "gpt-7b-1m", "gpt-13b-1m", "gpt-65b-1m"} <= {c.stem for c in CONFIGS}


@pytest.mark.parametrize("path", CLI_CONFIGS, ids=lambda p: p.stem)
def test_config_parses_and_builds_its_model_on_meta(path):
    raw = yaml.safe_load(path.read_text())
    strategy_config = raw["trainer"].pop("strategy")
    config = _parser().parse_object(raw)
    model = GPTPretraining(**config.model)
    strategy = SPPOTrainerStrategy(**strategy_config["init_args"])
    with torch.device("meta"):
        gpt = GPT(model.config)  # no memory, however large
    assert all(p.is_meta for p in gpt.parameters())
    assert sum(p.numel() for p in gpt.parameters()) == model.config.num_parameters()

    # The layout fits the world the trainer asks for, and the model and sequence fit the layout.
    world = raw["trainer"]["devices"] * raw["trainer"].get("num_nodes", 1)
    settings = strategy.config
    seq_len = config.data.seq_len
    assert seq_len <= model.config.block_size
    if settings.plans_layout:  # the planner picks the unset size at setup; the one given must divide the world
        ParallelDims.from_world(world, settings.pipeline_parallel or 1, settings.sequence_parallel or 1)
        return
    dims = ParallelDims.from_world(world, settings.pipeline_parallel, settings.sequence_parallel)
    dims.check_model(model.config)
    layers_per_stage(model.config, dims.pp, settings.layers_per_stage)
    assert seq_len % settings.boundary_granularity == 0
    if settings.num_subsequences != "auto":
        assert seq_len // settings.boundary_granularity >= settings.num_subsequences


def test_gpt65b_config_has_65b_parameters():
    raw = yaml.safe_load((CONFIGS[0].parent / "gpt-65b-1m.yaml").read_text())
    count = GPTPretraining(**raw["model"]).config.num_parameters()
    assert abs(count - 65e9) / 65e9 < 0.02, count
