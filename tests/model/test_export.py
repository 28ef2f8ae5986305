"""sppo-export: checkpoints of every format this project writes, loaded back by ``transformers``.

The distributed folder written by a real pipeline + FSDP layout is exported in tests/distributed/test_tied.py
and a Trainer ``.ckpt`` in tests/training/test_init_from.py; here the formats are built directly.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.model.export import main, read_checkpoint
from tests.model.hf_reference import batch, load_hf, rel
from tests.subprocesses import one_thread_env


def _fails(capsys, argv: list[str]) -> str:
    """The one line ``sppo-export argv`` ends with (exit status 2, no traceback)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    [line] = [line for line in err.splitlines() if line.startswith("sppo-export: error:")]
    return line


def _logits_match(model: GPT, out) -> None:
    ids, _ = batch(model.config.vocab_size, seq_len=40)
    with torch.no_grad():
        assert rel(load_hf(out)(ids).logits, model(ids)) < 1e-5


def _qwen3_tied() -> GPT:
    config = GPTConfig(vocab_size=96, n_layer=2, n_embd=64, n_head=4, n_query_groups=2, intermediate_size=80,
                       block_size=128, norm_qk=True, tie_embeddings=True, norm_eps=1e-6,
                       rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32))  # fmt: skip
    model = GPT(config)
    with torch.no_grad():
        for name, param in model.named_parameters():  # norms away from 1, so a misplaced one shows
            param.add_(0.2 * torch.randn_like(param)) if "norm" in name else None
    return model


def test_single_file_with_model_config(tmp_path):
    model = _qwen3_tied()
    saved = {"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}, "step": 3}
    torch.save(saved | {"model_config": model.config.to_dict()}, tmp_path / "single.pt")
    main([str(tmp_path / "single.pt"), str(tmp_path / "hf")])
    assert load_hf(tmp_path / "hf").config.architectures == ["Qwen3ForCausalLM"]
    _logits_match(model, tmp_path / "hf")


def test_distributed_folder_with_trainer_hyper_parameters_in_bfloat16(tmp_path):
    """A DCP folder as the Trainer writes it on several devices: the config from GPTPretraining's hparams."""
    torch.manual_seed(0)
    config = GPTConfig.from_name("tiny", block_size=512)
    model = GPT(config)
    state = {"model": model.state_dict(), "optimizer_0": {"state": {"wte.weight": {"exp_avg": torch.ones(3)}}}}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    hparams = {"model": "tiny", "model_overrides": {"block_size": 512}, "learning_rate": 1e-3}
    torch.save({"hyper_parameters": hparams, "global_step": 7}, tmp_path / "ckpt" / "meta.pt")
    main([str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--dtype", "bfloat16"])
    hf = load_hf(tmp_path / "hf")
    assert hf.config.architectures == ["LlamaForCausalLM"] and hf.config.max_position_embeddings == 512
    ids, _ = batch(config.vocab_size, seq_len=40)
    with torch.no_grad():
        assert rel(hf(ids).logits, model(ids)) < 2e-2  # bf16-rounded weights
        assert rel(hf(ids).logits, model.to(torch.bfloat16).float()(ids)) < 1e-5


def test_gpt_preset_needs_model_when_nothing_is_recorded(tmp_path, capsys):
    model = GPT(GPTConfig.from_name("tiny-gqa"))
    torch.save({"model": model.state_dict()}, tmp_path / "old.pt")
    assert "pass --model NAME" in _fails(capsys, [str(tmp_path / "old.pt"), str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()
    main([str(tmp_path / "old.pt"), str(tmp_path / "hf"), "--model", "tiny-gqa", "--override", "block_size=8192"])
    assert load_hf(tmp_path / "hf").config.max_position_embeddings == 8192
    _logits_match(model, tmp_path / "hf")


def test_architectures_without_hf_equivalent_and_wrong_files_are_clear_errors(tmp_path, capsys):
    torch.save({"model": GPT(GPTConfig.from_name("tiny-gelu")).state_dict()}, tmp_path / "gelu.pt")
    assert "mlp='gelu'" in _fails(capsys, [str(tmp_path / "gelu.pt"), str(tmp_path / "hf"), "--model", "tiny-gelu"])
    torch.save({"model": GPT(GPTConfig.from_name("tiny")).state_dict()}, tmp_path / "tiny.pt")
    line = _fails(capsys, [str(tmp_path / "tiny.pt"), str(tmp_path / "hf"), "--model", "tiny", "--override",
                           "norm_qk=true"])  # fmt: skip
    assert "lacks 'blocks.0.attn.norm_q.weight'" in line and "--model" in line  # --model of another shape
    torch.save({"a": {"x": torch.ones(1)}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="exactly one GPT state dict"):
        read_checkpoint(tmp_path / "other.pt")
    assert not (tmp_path / "hf").exists()  # nothing written by any of them


def _files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_an_export_never_leaves_files_of_an_earlier_one(tmp_path, capsys):
    """Sharded, then one file into the same folder: refused without --replace (the old export untouched), and
    with it the folder holds the new export only. Without the swap the 17 old shards and their index stayed
    beside the new model.safetensors, and a loader following the index read the old weights."""
    first, second = GPT(GPTConfig.from_name("tiny")), GPT(GPTConfig.from_name("tiny"))
    for name, model in (("first", first), ("second", second)):
        torch.save({"model": model.state_dict(), "model_config": model.config.to_dict()}, tmp_path / f"{name}.pt")
    out = tmp_path / "hf"
    main([str(tmp_path / "first.pt"), str(out), "--max-shard-gb", "0.0001"])
    sharded = _files(out)
    assert "model.safetensors.index.json" in sharded and len(sharded) > 3  # config, index and several shards
    line = _fails(capsys, [str(tmp_path / "second.pt"), str(out)])
    assert "--replace" in line and "out_dir" in line and _files(out) == sharded
    _logits_match(first, out)
    main([str(tmp_path / "second.pt"), str(out), "--replace"])
    assert _files(out) == ["config.json", "model.safetensors"]
    _logits_match(second, out)
    assert _files(tmp_path) == ["first.pt", "hf", "second.pt"]  # no temporary folder left


@pytest.mark.parametrize("size", ["0", "-1", "nan"])
def test_shard_sizes_must_be_positive(tmp_path, capsys, size):
    torch.save({"model": GPT(GPTConfig.from_name("tiny")).state_dict()}, tmp_path / "tiny.pt")
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "tiny.pt"), str(tmp_path / "hf"), "--model", "tiny", "--max-shard-gb", size])
    assert exit_.value.code == 2 and "--max-shard-gb" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_damaged_or_missing_checkpoints_and_misspelt_fields_are_one_line(tmp_path, capsys):
    model = GPT(GPTConfig.from_name("tiny"))
    good = tmp_path / "ckpts" / "epoch=0-step=2.ckpt"
    good.parent.mkdir()
    torch.save({"model": model.state_dict(), "model_config": model.config.to_dict()}, good)
    cut = tmp_path / "ckpts" / "epoch=0-step=4.ckpt"
    cut.write_bytes(good.read_bytes()[:-50])
    line = _fails(capsys, [str(cut), str(tmp_path / "hf")])
    assert "not a complete checkpoint" in line and "'epoch=0-step=2.ckpt'" in line  # what to export instead
    assert "does not exist" in _fails(capsys, [str(tmp_path / "none.ckpt"), str(tmp_path / "hf")])
    with pytest.raises(SystemExit) as exit_:
        main([str(good), str(tmp_path / "hf"), "--override", "n_layr=3"])
    assert exit_.value.code == 2 and "did you mean n_layer?" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert "is a file" in _fails(capsys, [str(good), str(tmp_path / "afile" / "hf")])
    assert _files(tmp_path) == ["afile", "ckpts"]


def test_tokenizer_files_come_along(tmp_path):
    """From --tokenizer (or the checkpoint's init_from folder): the tokenizer's files and generation_config.json,
    nothing else of that folder."""
    model = GPT(GPTConfig.from_name("tiny"))
    torch.save({"model": model.state_dict(), "model_config": model.config.to_dict()}, tmp_path / "tiny.pt")
    source = tmp_path / "source"
    source.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"):
        (source / name).write_text("{}")
    main([str(tmp_path / "tiny.pt"), str(tmp_path / "hf"), "--tokenizer", str(source)])
    expected = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert _files(tmp_path / "hf") == expected
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() != b"{}"  # the export's weights, not the source's


def test_the_folders_a_killed_export_left_are_removed_by_the_next(tmp_path):
    """A kill mid-export leaves its hidden folder beside OUT_DIR (OUT_DIR itself is never half written); the next
    export to OUT_DIR removes those of processes that are gone, and not those of one still running."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"], env=one_thread_env())
    gone.wait()
    killed = [tmp_path / f".hf.export-{gone.pid}", tmp_path / f".hf.replaced-{gone.pid}"]
    running = tmp_path / f".hf.export-{os.getppid()}"  # the negative control: its process is alive
    for folder in (*killed, running):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    model = GPT(GPTConfig.from_name("tiny"))
    torch.save({"model": model.state_dict(), "model_config": model.config.to_dict()}, tmp_path / "m.pt")
    main([str(tmp_path / "m.pt"), str(tmp_path / "hf")])
    assert not any(folder.exists() for folder in killed) and running.exists()
    _logits_match(model, tmp_path / "hf")


def test_tokenizer_files_of_the_checkpoints_own_choosing_must_be_that_folders_own(tmp_path, capsys, monkeypatch):
    """The checkpoint names the folder whose tokenizer files an export copies by default (its ``init_from``): a
    forged one names a folder of its own, relative to where the export runs, whose tokenizer.json links to a secret
    of the machine; the export would carry it into a folder one publishes. Refused in one line; the links of a
    Hugging Face cache (a snapshot's files into the repository's blobs) are followed."""
    from lightning_sppo.model.hf import copy_tokenizer_files

    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret").write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    model = GPT(GPTConfig.from_name("tiny"))
    state = {"model": model.state_dict(), "model_config": model.config.to_dict()}
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "tokenizer.json").symlink_to(tmp_path / "secret")
    torch.save(state | {"hyper_parameters": {"init_from": "evil"}}, tmp_path / "evil" / "model.pt")
    line = _fails(capsys, ["evil/model.pt", "hf"])
    assert f"links tokenizer.json to {str(tmp_path / 'secret')!r}, outside it" in line and "--tokenizer DIR" in line
    assert not (tmp_path / "hf").exists()
    (tmp_path / "before").mkdir()
    copy_tokenizer_files(tmp_path / "evil", tmp_path / "before")  # the negative control: the copy as it was
    assert (tmp_path / "before" / "tokenizer.json").read_text().startswith("-----BEGIN OPENSSH")
    snapshot = tmp_path / "hub" / "models--org--m" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "hub" / "models--org--m" / "blobs").mkdir()
    (tmp_path / "hub" / "models--org--m" / "blobs" / "f00d").write_text('{"version": "1.0"}')
    (snapshot / "tokenizer.json").symlink_to("../../blobs/f00d")
    torch.save(state | {"hyper_parameters": {"init_from": str(snapshot)}}, tmp_path / "cached.pt")
    main(["cached.pt", "hf"])
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == '{"version": "1.0"}'
