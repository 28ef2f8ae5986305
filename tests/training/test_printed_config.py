"""``sppo fit --print_config`` prints what runs (issue 39 item 3): the checkpoint callback and the logger the command
adds (a config without them printed ``callbacks: null`` and ``logger: null``), outputs placed under
``trainer.default_root_dir``, which of ``model.model`` and ``model.init_from`` decides the architecture; and the
printed config, run as is, prints (and so runs) the same."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from lightning_sppo.training.cli import main

MY_YAML = {
    "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 5},
    "model": {"model": "tiny"},
    "data": {"path": "data/demo", "seq_len": 64, "batch_size": 2},
}
LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["sppo"])  # the command's own arguments only
    (tmp_path / "my.yaml").write_text(yaml.safe_dump(MY_YAML))
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(LLAMA))
    return tmp_path


def _printed(capsys, *args: str) -> tuple[str, dict]:
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *args, "--print_config"])
    out = capsys.readouterr().out
    assert exit_.value.code in (0, None), out
    return out, yaml.safe_load(out)


def _classes(entries) -> list[str]:
    entries = entries if isinstance(entries, list) else [entries]
    return [e["class_path"] for e in entries if e]


def test_the_callbacks_and_the_logger_that_run_are_printed(folder, capsys):
    text, config = _printed(capsys, "--config", "my.yaml")
    trainer = config["trainer"]
    checkpoint = next(c for c in trainer["callbacks"] if c["class_path"] == "lightning_sppo.callbacks.SPPOCheckpoint")
    assert checkpoint["init_args"]["dirpath"] == "./checkpoints" and checkpoint["init_args"]["keep"] == 2
    assert checkpoint["init_args"]["every_n_train_steps"] is None  # the end of fit only: said, not hidden
    assert _classes(trainer["logger"]) == ["lightning.pytorch.loggers.CSVLogger"]
    assert trainer["logger"]["init_args"]["save_dir"] == "."
    assert "# Model: 'tiny' (0.2M parameters" in text and "architecture from model.model='tiny'" in text
    assert "  model: tiny  # decides the architecture (model.init_from is unset)" in text
    assert "sppo-plan --model tiny --seq-len 64" in text  # where the planner's predictions come from


def test_init_from_is_said_to_decide_the_architecture(folder, capsys):
    text, config = _printed(capsys, "--config", "my.yaml", "--model.model", "small", "--model.init_from", "llama")
    assert "  model: small  # ignored: model.init_from decides the architecture" in text
    assert "  init_from: llama  # decides the architecture (and the initial weights)" in text
    assert "architecture from model.init_from (config.json of llama); model.model='small' is ignored" in text
    assert config["model"]["init_from"] == "llama"


def test_what_the_settings_turn_off_is_not_printed_and_listed_entries_are_kept(folder, capsys):
    _, config = _printed(capsys, "--config", "my.yaml", "--trainer.enable_checkpointing", "false",
                         "--trainer.logger", "false", "--trainer.enable_progress_bar", "false")  # fmt: skip
    assert not config["trainer"]["callbacks"] and config["trainer"]["logger"] is False
    mine = {"class_path": "lightning_sppo.callbacks.SPPOCheckpoint", "init_args": {"every_n_train_steps": 3}}
    (folder / "mine.yaml").write_text(yaml.safe_dump({**MY_YAML, "trainer": {**MY_YAML["trainer"], "callbacks": [mine],
                                                                             "default_root_dir": "runs/a"}}))  # fmt: skip
    _, config = _printed(capsys, "--config", "mine.yaml")
    checkpoints = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("SPPOCheckpoint")]
    assert len(checkpoints) == 1 and checkpoints[0]["init_args"]["every_n_train_steps"] == 3
    assert checkpoints[0]["init_args"]["dirpath"] == "runs/a/checkpoints"
    assert config["trainer"]["logger"]["init_args"]["save_dir"] == "runs/a"


def test_the_printed_config_prints_itself(folder, capsys):
    """What is printed is a config that runs as the settings it came from: printed again, it is the same."""
    first, _ = _printed(capsys, "--config", "my.yaml", "--trainer.default_root_dir", "runs/b")
    (folder / "printed.yaml").write_text(first)
    again, _ = _printed(capsys, "--config", "printed.yaml")
    settings = [line for line in first.splitlines() if not line.startswith("#")]
    assert settings == [line for line in again.splitlines() if not line.startswith("#")]


def test_an_unknown_flag_is_one_line(folder, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", "my.yaml", "--print_config=everything"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sppo: error:")]
    assert exit_.value.code == 2 and len(errors) == 1 and "--print_config=everything" in errors[0], errors


def test_a_placeholder_init_from_still_prints_and_says_the_run_would_stop(folder, capsys):
    text, config = _printed(capsys, "--config", "my.yaml", "--model.init_from", "/models/REPLACE-ME/x")
    assert "# Model: not known yet; a run would stop here: model.init_from='/models/REPLACE-ME/x'" in text
    assert config["model"]["init_from"] == "/models/REPLACE-ME/x"
