"""Every shipped YAML parses against the entry points, stands alone, and its model builds on the meta device."""

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import CLI, ArgumentParser

from lightning_sppo import GPT, GPTConfig, SPPOTrainerStrategy
from lightning_sppo.data import TokenDataModule
from lightning_sppo.model.hf import hf_config
from lightning_sppo.parallel import ParallelDims, layers_per_stage
from lightning_sppo.training import GPTPretraining
from lightning_sppo.training.cli import SPPOCLI, _parser_kwargs

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
CLI_CONFIGS = [c for c in CONFIGS if not c.name.startswith("fabric-")]
FABRIC_CONFIGS = [c for c in CONFIGS if c.name.startswith("fabric-")]
HF_CONFIGS = [c for c in CLI_CONFIGS if "init_from" in yaml.safe_load(c.read_text())["model"]]
PLACEHOLDER = "REPLACE-ME"
"""In the path of every shipped ``model.init_from``: the folder the user puts there is theirs."""


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
    continued = {"llama-3.2-1b-128k", "llama-3.1-8b-128k", "llama-3.1-8b-512k", "qwen2.5-7b-256k"}
    assert continued <= {c.stem for c in HF_CONFIGS}


@pytest.mark.parametrize("path", HF_CONFIGS, ids=lambda p: p.stem)
def test_hf_config_states_its_plan_and_continues_on_packed_masked_documents(path):
    """A config from a Hugging Face checkpoint: the planner command that gave its layout at the top, a marked
    init_from placeholder, packed documents each attending only to itself, W&B, validation and checkpoints."""
    text = path.read_text()
    raw = yaml.safe_load(text)
    header = text[: text.index("seed_everything")]
    assert "sppo-plan --model " + raw["model"]["model"] in header and "tokens/GPU/s" in header
    assert "GiB" in header and "host" in header
    assert f"sppo fit --config configs/{path.name}" in header and "sppo-export" in header
    assert PLACEHOLDER in raw["model"]["init_from"] and "sppo-prepare" in header and "--tokenizer" in header
    assert raw["data"]["packing"] is True and raw["data"]["document_mask"] is True
    assert raw["data"]["val_fraction"] > 0 and raw["trainer"]["val_check_interval"]
    assert any(logger["class_path"].endswith("WandbLogger") for logger in raw["trainer"]["logger"])
    assert any(c["class_path"].endswith("SPPOCheckpoint") for c in raw["trainer"]["callbacks"])
    block_size = raw["model"].get("model_overrides", {}).get("block_size")
    assert raw["data"]["seq_len"] <= (block_size or GPTConfig.from_name(raw["model"]["model"]).block_size)


def _stand_in_checkpoint(folder: Path, preset: str) -> str:
    """A Hugging Face folder holding only the config.json of the preset (no weights are read at construction)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(GPTConfig.from_name(preset))))
    return str(folder)


@pytest.mark.parametrize("path", CLI_CONFIGS, ids=lambda p: p.stem)
def test_config_parses_and_builds_its_model_on_meta(path, tmp_path):
    raw = yaml.safe_load(path.read_text())
    strategy_config = raw["trainer"].pop("strategy")
    config = _parser().parse_object(raw)
    if config.model.init_from is not None:  # the placeholder stands for the preset's Hugging Face folder
        assert PLACEHOLDER in config.model.init_from
        config.model.init_from = _stand_in_checkpoint(tmp_path / "hf", config.model.model)
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


def _printed(run) -> dict:
    """The config a command resolves (``--print_config``), as a dict."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        run()
    assert exit_.value.code in (None, 0)
    return yaml.safe_load(out.getvalue())


@pytest.mark.parametrize("path", CLI_CONFIGS, ids=lambda p: p.stem)
def test_config_stands_alone_in_the_sppo_command(path, monkeypatch):
    """The `sppo fit` parser itself (Trainer options, loggers, callbacks) takes the file with nothing layered
    under it; outputs follow default_root_dir; no epoch-length workaround is left."""
    args = ["fit", "--config", str(path), "--print_config"]
    monkeypatch.setattr("sys.argv", ["sppo"])  # the arguments come from args
    resolved = _printed(lambda: SPPOCLI(GPTPretraining, TokenDataModule, args=args, parser_kwargs=_parser_kwargs(args)))
    trainer = resolved["trainer"]
    assert trainer["limit_train_batches"] is None, "resume is exact at any step: no 50-step epochs"
    root = trainer["default_root_dir"]
    assert root, "outputs go under trainer.default_root_dir"
    # --print_config shows where they go (issue 39): every logger's save_dir and the checkpoints' dirpath under it
    assert all(logger["init_args"]["save_dir"] == root for logger in trainer["logger"])
    checkpoints = [c for c in trainer["callbacks"] if c["class_path"].endswith("SPPOCheckpoint")]
    assert len(checkpoints) == 1 and checkpoints[0]["init_args"]["dirpath"] == f"{root}/checkpoints"
    assert resolved["data"]["val_fraction"] > 0 and trainer["val_check_interval"] is not None


@pytest.mark.parametrize("path", FABRIC_CONFIGS, ids=lambda p: p.stem)
def test_fabric_config_parses_against_the_recipe(path, monkeypatch):
    spec = importlib.util.spec_from_file_location("pretrain_fabric", path.parents[1] / "recipes/pretrain_fabric.py")
    recipe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "pretrain_fabric", recipe)  # its dataclasses look their module up
    spec.loader.exec_module(recipe)
    resolved = _printed(lambda: CLI(recipe.setup, as_positional=False, args=["--config", str(path), "--print_config"]))
    assert resolved["data"]["path"] == "data/demo" and "batches_per_epoch" not in resolved["train"]
