"""A Hugging Face folder given as ``--model.init_from`` that is damaged, forged or points elsewhere (red team of
issue 36): one line naming the file, before any model is built; never a file outside the folder, never the
traceback of ``json`` or ``safetensors``, never an allocation of whatever size config.json declares.

The folders are written here (``save_hf_model`` of a tiny GPT), then edited. Negative controls: the same files
read as before (``json``, ``safetensors.safe_open``, ``hf_model_config``) raise those libraries' own errors or
accept what is refused here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import SafetensorError, safe_open

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.errors import SPPOConfigError
from lightning_sppo.model.hf import hf_model_config, load_hf_weights, save_hf_model
from lightning_sppo.training.model_source import load_initial_weights, model_config

CONFIG = GPTConfig.from_name("tiny", n_embd=32, n_head=2, n_query_groups=2, intermediate_size=64)


@pytest.fixture
def folder(tmp_path) -> Path:
    save_hf_model(GPT(CONFIG), tmp_path / "hf")
    return tmp_path / "hf"


def _tensor_names(file: Path) -> list[str]:
    with safe_open(file, framework="pt") as f:
        return list(f.keys())


def _one_line(raised: pytest.ExceptionInfo, *texts: str) -> str:
    message = str(raised.value)
    assert "\n" not in message and all(text in message for text in texts), message
    return message


def _index(folder: Path, weight_map) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_an_index_naming_a_file_outside_its_folder_is_refused(folder, tmp_path):
    """A sharded folder's index maps tensor names to files: ``../`` or an absolute path would read a file of the
    reader's machine instead of the folder's."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(folder, elsewhere)
    names = _tensor_names(folder / "model.safetensors")
    for target in ("../elsewhere/model.safetensors", str(elsewhere / "model.safetensors")):
        _index(folder, dict.fromkeys(names, target))
        with pytest.raises(ValueError) as raised:
            load_hf_weights(GPT(CONFIG), folder)
        _one_line(raised, "model.safetensors.index.json maps", repr(target), "which is not a file of its folder")
        assert (folder / target).is_file()  # the negative control: the path reads a real checkpoint's file


def test_a_damaged_index_or_safetensors_file_is_one_line_naming_it(folder):
    (folder / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError) as raised:
        model_config("tiny", None, str(folder))
    _one_line(raised, "model.init_from=", "model.safetensors.index.json is not a JSON file")
    (folder / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(SPPOConfigError, match="has no weight_map object"):
        model_config("tiny", None, str(folder))
    (folder / "model.safetensors.index.json").unlink()
    data = (folder / "model.safetensors").read_bytes()
    for damaged in (data[:200], b"\xff" * 500):
        (folder / "model.safetensors").write_bytes(damaged)
        with pytest.raises(SPPOConfigError) as raised:
            model_config("tiny", None, str(folder))
        _one_line(raised, "model.safetensors cannot be read as a safetensors file")
        with pytest.raises(SafetensorError):  # the negative control: safetensors' own error
            safe_open(folder / "model.safetensors", framework="pt")


def test_a_config_json_declaring_a_larger_model_than_its_weights_is_refused_before_it_is_built(folder):
    """``vocab_size`` 2**40 in config.json over a tiny model's weights: every rank would allocate that embedding
    (an allocation error, or an OOM kill for a size just under the memory) before any weight was compared."""
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(hf | {"vocab_size": 2**40}))
    assert hf_model_config(folder).vocab_size == 2**40  # the negative control: config.json alone is taken
    with pytest.raises(SPPOConfigError) as raised:
        model_config("tiny", None, str(folder))
    _one_line(raised, "model.init_from=", "has shape (256, 32), but its config.json makes wte.weight")


def test_loading_the_weights_inside_fit_is_one_line_naming_init_from(folder):
    """``load_initial_weights`` runs in ``on_fit_start``, outside the command's set-up checks: its errors (the
    folder changed since the run started, a shard gone) are one ``SPPOConfigError`` line too, not a traceback."""
    names = _tensor_names(folder / "model.safetensors")
    _index(folder, dict.fromkeys(names, "missing.safetensors"))
    with pytest.raises(SPPOConfigError) as raised:
        load_initial_weights(GPT(CONFIG), str(folder))
    _one_line(raised, f"model.init_from={str(folder)!r}", "missing.safetensors cannot be read")
    with pytest.raises(FileNotFoundError):  # the negative control: what load_hf_weights met, as safetensors says it
        safe_open(folder / "missing.safetensors", framework="pt")
