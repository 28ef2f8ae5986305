"""Advice that works when followed (issue 39 item 2): for each mistake, the command ends with one ``PROG: error:``
line, the test reads the advice out of that line (the values, the command, the key it names), runs it, and
requires the run to succeed. Before issue 39 each of these advised something that failed in turn: pp=3 for 3
processes and a 2-layer model, ``model.model_overrides.vocab_size`` beside an ``init_from`` (a 32-line traceback),
``sppo-prepare ... --output corpus.txt`` for a text file given as ``data.path``, and no "did you mean" inside a
callback's or a logger's ``init_args``. Commands run forked from the preloaded server (``tests/preloaded.py``)."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests import preloaded
from tests.subprocesses import one_thread_env
from tests.training.cli_runs import DEMO_TOKENS, copy_token_file

pytestmark = pytest.mark.slow  # each case runs the command twice, some on 2 or 3 processes

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 1, "logger": False, "enable_progress_bar": False,
                "enable_model_summary": False, "enable_checkpointing": False},
    "model": {"model": "tiny"},
    "data": {"path": "data/demo", "seq_len": 32, "batch_size": 2},
}  # fmt: skip


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    copy_token_file(DEMO_TOKENS, tmp_path / "data" / "demo")
    _config(tmp_path, "my.yaml")
    return tmp_path


def _config(work: Path, name: str, **trainer) -> str:
    config = {**CONFIG, "trainer": {**CONFIG["trainer"], **trainer}}
    (work / name).write_text(yaml.safe_dump(config))
    return name


def _run(work: Path, module: str, *args: str) -> tuple[int, str, list[str]]:
    """(exit status, output, the error lines) of ``python -m module args``."""
    prog = "sppo-prepare" if module.endswith("prepare") else "sppo"
    done = preloaded.run([sys.executable, "-m", module, *args], env=one_thread_env(), cwd=work, timeout=600)
    output = done.stdout + done.stderr
    return done.returncode, output, [line for line in output.splitlines() if line.startswith(f"{prog}: error:")]


def _sppo(work: Path, *args: str) -> tuple[int, str, list[str]]:
    return _run(work, "lightning_sppo.training.cli", "fit", "--config", "my.yaml", *args)


def _one_error(result: tuple[int, str, list[str]]) -> str:
    code, output, errors = result
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output[-3000:]
    return errors[0]


def _succeeds(result: tuple[int, str, list[str]]) -> None:
    code, output, errors = result
    assert code == 0 and not errors, output[-3000:]


def _values(line: str, setting: str) -> list[int]:
    """The list of values the line offers for ``setting`` (``valid pipeline_parallel values (...): [1]``)."""
    found = re.search(rf"valid {setting} values[^:]*: \[([\d, ]+)\]", line, re.IGNORECASE)
    assert found, line
    return [int(v) for v in found.group(1).split(",")]


@pytest.mark.parametrize(
    ("devices", "bad", "setting", "model"),
    [
        (3, {"pipeline_parallel": 2}, "pipeline_parallel", {}),  # the issue's: it advised [1, 3]
        (2, {"sequence_parallel": 2}, "sequence_parallel", {"n_query_groups": 1}),  # one K/V group cannot be split
    ],
    ids=["pp-3-processes-2-layers", "sp-one-kv-group"],
)
def test_layout_advice_runs(work: Path, devices: int, bad: dict, setting: str, model: dict):
    overrides = ("--model.model_overrides", yaml.safe_dump(model, default_flow_style=True).strip()) if model else ()
    options = [arg for key, value in bad.items() for arg in (f"--trainer.strategy.init_args.{key}", str(value))]
    line = _one_error(_sppo(work, "--trainer.devices", str(devices), *options, *overrides))
    assert "trainer.strategy.init_args: " in line and "world size" in line, line
    values = _values(line, setting)
    assert values == [1], line  # the only size both the model and the world allow
    followed = {**bad, setting: values[-1]}
    options = [arg for key, value in followed.items() for arg in (f"--trainer.strategy.init_args.{key}", str(value))]
    _succeeds(_sppo(work, "--trainer.devices", str(devices), *options, *overrides))


def _tiny_llama(folder: Path, vocab_size: int, tokenizer_from: Path | None) -> None:
    """A random Llama of ``vocab_size`` made by transformers; with ``tokenizer_from`` (a text file), a byte-level BPE
    tokenizer of at most ``vocab_size`` entries trained on it, saved beside the weights."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    if tokenizer_from is not None:
        from tokenizers import ByteLevelBPETokenizer

        tokenizer = ByteLevelBPETokenizer()
        tokenizer.train([str(tokenizer_from)], vocab_size=vocab_size - 12, show_progress=False)
        tokenizer.save(str(folder / "tokenizer.json"))


def _token_file_of_vocab(work: Path, name: str, vocab_size: int) -> None:
    """data/demo's tokens, recorded with a larger vocabulary (what another tokenizer's file looks like)."""
    import json

    for suffix in ("bin", "idx"):
        shutil.copy(work / "data" / f"demo.{suffix}", work / "data" / f"{name}.{suffix}")
    meta = json.loads((work / "data" / "demo.json").read_text()) | {"vocab_size": vocab_size}
    (work / "data" / f"{name}.json").write_text(json.dumps(meta))


def test_a_vocabulary_init_from_cannot_hold_is_prepared_with_its_tokenizer(work: Path):
    """A 628-id token file for a 512-id ``init_from``: the advice is init_from's tokenizer (no setting can fix it);
    ``sppo-prepare`` as the line writes it, then ``sppo fit`` on the new token file, trains."""
    corpus = work / "corpus.txt"
    corpus.write_text("".join(p.read_text() for p in sorted((ROOT / "data" / "corpus").glob("*.txt"))))
    _tiny_llama(work / "tiny-llama", 512, corpus)
    _token_file_of_vocab(work, "v628", 628)
    line = _one_error(_sppo(work, "--model.init_from", "tiny-llama", "--data.path", "data/v628"))
    assert "model.init_from='tiny-llama' fixes the vocabulary" in line and "model_overrides.vocab_size" not in line
    command = re.search(r"sppo-prepare TEXTS --output NAME --tokenizer (\S+?)\)", line)
    assert command and command.group(1) == "tiny-llama", line
    prepared = _run(work, "lightning_sppo.data.prepare", "corpus.txt", "--output", "data/llama", "--tokenizer",
                    command.group(1))  # fmt: skip
    assert prepared[0] == 0, prepared[1][-2000:]
    _succeeds(_sppo(work, "--model.init_from", "tiny-llama", "--data.path", "data/llama"))


def test_an_override_that_reshapes_init_from_s_weights_is_refused_before_the_load(work: Path):
    """``model.model_overrides.vocab_size`` beside ``init_from`` (what the old advice said) ended in a 32-line
    traceback at the load; now one line says to remove it, and without it the run trains."""
    _tiny_llama(work / "tiny-llama", 512, None)
    override = ("--model.model_overrides", '{"vocab_size": 628, "block_size": 8192}')
    line = _one_error(_sppo(work, "--model.init_from", "tiny-llama", *override))
    removed = re.search(r"Remove ([\w, ]+) from model.model_overrides", line)
    assert removed and removed.group(1) == "vocab_size", line
    _succeeds(_sppo(work, "--model.init_from", "tiny-llama", "--model.model_overrides", '{"block_size": 8192}'))


def test_a_misspelt_init_args_key_of_a_callback_or_a_logger_gets_its_did_you_mean(work: Path):
    config = yaml.safe_load((work / "my.yaml").read_text())
    config["trainer"] |= {
        "enable_checkpointing": True,
        "callbacks": [{"class_path": "lightning_sppo.callbacks.SPPOCheckpoint",
                       "init_args": {"every_n_train_step": 1}}],
        "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dri": ""}}],
    }  # fmt: skip
    wrong = [(config["trainer"]["callbacks"][0], "every_n_train_step"), (config["trainer"]["logger"][0], "save_dri")]
    for entry, key in wrong:
        (work / "my.yaml").write_text(yaml.safe_dump(config))
        line = _one_error(_sppo(work))
        suggested = re.search(r"did you mean init_args\.(\w+) \(an argument of ([\w.]+)", line)
        assert suggested and suggested.group(2) == entry["class_path"], line
        entry["init_args"][suggested.group(1)] = entry["init_args"].pop(key)  # the advice, followed
    (work / "my.yaml").write_text(yaml.safe_dump(config))
    _succeeds(_sppo(work))
    assert list((work / "checkpoints").glob("*step=1.ckpt")), list(work.rglob("*"))  # every_n_train_steps: 1 ran


def test_a_text_file_as_data_path_is_prepared_as_the_line_says(work: Path):
    (work / "notes.txt").write_text((ROOT / "README.md").read_text()[:4000])
    line = _one_error(_sppo(work, "--data.path", "notes.txt"))
    command = re.search(r"`sppo-prepare (\S+) --output (\S+)` and set data.path: (\S+)\.$", line)
    assert command and command.group(2) == command.group(3) and command.group(2) != "notes.txt", line
    prepared = _run(work, "lightning_sppo.data.prepare", command.group(1), "--output", command.group(2))
    assert prepared[0] == 0, prepared[1][-2000:]
    _succeeds(_sppo(work, "--data.path", command.group(3)))


def test_an_empty_corpus_file_is_named(work: Path):
    (work / "empty.txt").write_text("")
    line = _one_error(_sppo(work, "--data.path", "empty.txt"))
    assert "data.path='empty.txt' is an empty file" in line, line
    prepare = _run(work, "lightning_sppo.data.prepare", "empty.txt", "--output", "data/empty")
    assert prepare[0] == 2 and prepare[2] == ["sppo-prepare: error: INPUT empty.txt holds no text: nothing to write;"
                                              " give files that hold text"], prepare[1]  # fmt: skip
