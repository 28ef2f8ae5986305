"""'did you mean ...?' for unknown options and config keys of the `sppo` command."""

from __future__ import annotations

import pytest
import yaml
from jsonargparse import ArgumentParser

from lightning_sppo import SPPOTrainerStrategy
from lightning_sppo.training.cli import main
from lightning_sppo.training.suggest import close_match, known_options, suggestion

KNOWN = ["model.learning_rate", "model.min_learning_rate", "model.model", "trainer.max_steps", "data.seq_len",
         "trainer.strategy.init_args.pipeline_parallel", "trainer.strategy.init_args.partition"]  # fmt: skip


def test_close_match_looks_in_the_option_s_namespace_first():
    assert close_match("model.learning_rat", KNOWN) == "model.learning_rate"
    assert close_match("model.min_learning_rat", KNOWN) == "model.min_learning_rate"
    assert close_match("modle.model", KNOWN) == "model.model"  # a misspelt namespace: the whole name
    assert close_match("data.seq_len", KNOWN) == "data.seq_len"
    assert close_match("model.max_steps", KNOWN) is None  # a known namespace: never a leaf of another one
    assert close_match("model.zzzzqq", KNOWN) is None


@pytest.mark.parametrize(
    ("message", "hint"),
    [
        ("unrecognized arguments: --model.learning_rat 1e-3", "did you mean --model.learning_rate?"),
        (
            "unrecognized arguments: --model.learning_rat=1e-3 --trainer.max_step 3",
            "did you mean --model.learning_rate and --trainer.max_steps?",
        ),
        ("Subcommand 'fit' does not accept option 'model.learning_rat'", "did you mean model.learning_rate?"),
        ("Group 'model' does not accept option 'learning_rat'", "did you mean model.learning_rate?"),
        ("Option 'modle.model' is not accepted", "did you mean model.model?"),
        (
            "Parser key \"trainer.strategy\":\n  Errors:\n    - Option 'pipline_parallel' is not accepted",
            "did you mean trainer.strategy.init_args.pipeline_parallel?",
        ),
        (  # a key inside a listed class's init_args (issue 39: no suggestion before)
            'Parser key "trainer.callbacks":\n  Errors:\n    - Problem with given class_path'
            " 'lightning_sppo.callbacks.SPPOCheckpoint':\n        Option 'every_n_train_step' is not accepted\n"
            "  Given value type: <class 'list'>",
            "did you mean init_args.every_n_train_steps (an argument of lightning_sppo.callbacks.SPPOCheckpoint, in"
            " trainer.callbacks)?",
        ),
        (  # a setting that holds one class: the whole dotted name
            'Parser key "trainer.logger":\n  - Problem with given class_path'
            " 'lightning.pytorch.loggers.CSVLogger':\n      Option 'flush_logs_every_n_step' is not accepted",
            "did you mean trainer.logger.init_args.flush_logs_every_n_steps (an argument of"
            " lightning.pytorch.loggers.CSVLogger)?",
        ),
        ("Problem with given class_path 'no.such.Class':\n  Option 'x' is not accepted", None),
        ("unrecognized arguments: --model.zzzzqq 1", None),
        ("Parser key \"data.seq_len\":\n  Expected a <class 'int'>. Got value: x", None),
    ],
)
def test_suggestion_for_each_way_jsonargparse_names_an_unknown_option(message, hint):
    assert suggestion(message, KNOWN) == hint


def test_known_options_are_the_parser_s_and_the_strategy_s():
    parser = ArgumentParser()
    parser.add_argument("--model.learning_rate", type=float)
    known = known_options([parser], SPPOTrainerStrategy)
    assert "model.learning_rate" in known and "help" in known
    assert "trainer.strategy.init_args.pipeline_parallel" in known and "trainer.strategy.init_args.self" not in known


def _errors(capsys, *args: str) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    return exit_.value.code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("sppo:")]


def test_the_command_says_did_you_mean_on_one_line_with_status_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPPO_TRACEBACK", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # main() sets it when unset: restored after the test
    monkeypatch.setattr("sys.argv", ["sppo"])  # what main reads is its argument, as the console script's argv
    assert _errors(capsys, "fit", "--model.learning_rat", "1e-3") == (
        2,
        ["sppo: error: unrecognized arguments: --model.learning_rat 1e-3; did you mean --model.learning_rate?"],
    )
    config = {"trainer": {"max_steps": 7}, "model": {"model": "tiny", "learning_rat": 0.1}}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(config | {"data": {"path": "corpus", "seq_len": 32}}))
    code, errors = _errors(capsys, "fit", "--config", str(tmp_path / "mine.yaml"))
    assert code == 2 and len(errors) == 1 and errors[0].endswith("did you mean model.learning_rate?"), errors
    code, errors = _errors(capsys, "fit", "--model.zzzzqq", "1")  # nothing close: the pointer to --help
    assert code == 2 and errors == ["sppo: error: unrecognized arguments: --model.zzzzqq 1 (see `sppo fit --help`)"]
