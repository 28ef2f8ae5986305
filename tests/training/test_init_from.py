"""``GPTPretraining(init_from=DIR)`` on the Trainer: training starts from the Hugging Face weights, a resumed
run from its checkpoint, and the Trainer's ``.ckpt`` exports back to Hugging Face."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sppo import SPPOTrainerStrategy
from lightning_sppo.data import TokenDataModule, write_tokens
from lightning_sppo.errors import SPPOConfigError, is_settings_error
from lightning_sppo.model.export import main as export
from lightning_sppo.model.hf import load_hf_model
from lightning_sppo.training import GPTPretraining
from lightning_sppo.training.model_source import PLACEHOLDER
from tests.model.hf_reference import batch, hf_loss_and_grads, load_hf, rel, save_hf_checkpoint

ROOT = Path(__file__).resolve().parents[2]


class _Record(Callback):
    """The first batch, its loss, and the weights the step starts from."""

    def __init__(self) -> None:
        self.batches, self.losses, self.start = [], [], None

    def on_train_start(self, trainer, module) -> None:  # after any checkpoint restore
        self.start = {k: v.clone() for k, v in module.model.state_dict().items()}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.batches.append(batch)
        self.losses.append(outputs["loss"].item() if isinstance(outputs, dict) else outputs.item())


def _fit(tmp_path, max_steps: int, ckpt_path=None) -> tuple[GPTPretraining, _Record]:
    record = _Record()
    trainer = Trainer(
        strategy=SPPOTrainerStrategy(num_subsequences=2), accelerator="cpu", devices=1, max_steps=max_steps,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[record, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
    )  # fmt: skip
    module = GPTPretraining(init_from=str(tmp_path / "hf"), model_overrides={"block_size": 256},
                            learning_rate=1e-2, warmup_steps=0, max_steps=max_steps)  # fmt: skip
    data = TokenDataModule(tmp_path / "toy", seq_len=96, batch_size=2)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return module, record


def test_init_from_trains_from_hf_weights_resumes_from_the_checkpoint_and_exports(tmp_path):
    hf = save_hf_checkpoint("llama3-scaling-tied", tmp_path / "hf")
    gen = torch.Generator().manual_seed(0)
    write_tokens(tmp_path / "toy", [torch.randint(0, 96, (2000,), generator=gen).tolist()], vocab_size=96)

    module, record = _fit(tmp_path, max_steps=2)
    assert module.config.block_size == 256 and module.config.tie_embeddings  # config.json + model_overrides
    first = record.batches[0]
    _, ref_loss, _ = hf_loss_and_grads(hf, first["input_ids"], first["targets"])
    assert abs(record.losses[0] - ref_loss.item()) / ref_loss.item() < 1e-5  # the first step ran on HF's weights

    last = tmp_path / "ckpt" / "last.ckpt"
    export([str(last), str(tmp_path / "exported")])  # hyper_parameters -> init_from's config.json + overrides
    exported = load_hf(tmp_path / "exported")
    assert exported.config.max_position_embeddings == 256
    ids, _ = batch(96)
    with torch.no_grad():
        assert rel(exported(ids).logits, module.model(ids)) < 1e-5

    trained = {k: v.clone() for k, v in module.model.state_dict().items()}
    assert rel(trained["wte.weight"], hf.model.embed_tokens.weight.detach()) > 1e-4  # it trained
    _, resumed = _fit(tmp_path, max_steps=3, ckpt_path=last)
    for name, value in trained.items():  # the checkpoint's weights, not config.json's folder
        assert torch.equal(resumed.start[name], value), name


def test_the_checkpoint_carries_its_architecture_and_the_export_its_tokenizer(tmp_path):
    """model_config in the Trainer's checkpoint: the export needs no init_from folder (it used to fail once that
    folder had moved); while the folder is there, its tokenizer files are copied into the export."""
    save_hf_checkpoint("llama3-scaling-tied", tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text('{"model": "a tokenizer"}')
    (tmp_path / "hf" / "generation_config.json").write_text('{"eos_token_id": 1}')
    gen = torch.Generator().manual_seed(0)
    write_tokens(tmp_path / "toy", [torch.randint(0, 96, (2000,), generator=gen).tolist()], vocab_size=96)
    module, _ = _fit(tmp_path, max_steps=1)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=False)["model_config"] == module.config.to_dict()
    export([str(last), str(tmp_path / "with-tokenizer")])
    assert sorted(p.name for p in (tmp_path / "with-tokenizer").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]  # fmt: skip
    (tmp_path / "hf").rename(tmp_path / "moved")
    export([str(last), str(tmp_path / "exported")])
    exported = load_hf(tmp_path / "exported")
    ids, _ = batch(96)
    with torch.no_grad():
        assert exported.config.max_position_embeddings == 256
        assert rel(exported(ids).logits, module.model(ids)) < 1e-5


def test_init_from_a_checkpoint_takes_its_weights_only(tmp_path):
    """--model.init_from CHECKPOINT (the way on that a resume into another architecture's settings names): the
    architecture and weights of the checkpoint, model_overrides on top, a fresh step count and optimizer."""
    save_hf_checkpoint("llama3-scaling-tied", tmp_path / "hf")
    gen = torch.Generator().manual_seed(0)
    write_tokens(tmp_path / "toy", [torch.randint(0, 96, (2000,), generator=gen).tolist()], vocab_size=96)
    module, _ = _fit(tmp_path, max_steps=2)
    trained = {k: v.clone() for k, v in module.model.state_dict().items()}
    record = _Record()
    trainer = Trainer(
        strategy=SPPOTrainerStrategy(num_subsequences=2), accelerator="cpu", devices=1, max_steps=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[record],
    )  # fmt: skip
    again = GPTPretraining(init_from=str(tmp_path / "ckpt" / "last.ckpt"), model_overrides={"block_size": 512})
    trainer.fit(again, TokenDataModule(tmp_path / "toy", seq_len=96, batch_size=2))
    assert again.config.block_size == 512 and again.config.n_layer == module.config.n_layer
    assert trainer.global_step == 1  # a new run: its own first step
    for name, value in trained.items():
        assert torch.equal(record.start[name], value), name
    assert again.config.tie_embeddings and again.config.rope_scaling is not None  # the checkpoint's, not "tiny"'s
    assert not GPTPretraining().config.tie_embeddings and GPTPretraining().config.rope_scaling is None


def test_fabric_recipe_starts_from_init_from(tmp_path, monkeypatch):
    """recipes/pretrain_fabric.py --init_from: with a negligible learning rate the saved model is the HF model."""
    import importlib.util

    from lightning.fabric import Fabric

    from lightning_sppo import SPPOStrategy

    spec = importlib.util.spec_from_file_location("pretrain_fabric", ROOT / "recipes" / "pretrain_fabric.py")
    recipe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, recipe)  # its dataclasses look their module up
    spec.loader.exec_module(recipe)
    save_hf_checkpoint("qwen2.5-bias", tmp_path / "hf")
    gen = torch.Generator().manual_seed(0)
    write_tokens(tmp_path / "toy", [torch.randint(0, 96, (1000,), generator=gen).tolist()], vocab_size=96)
    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=2), accelerator="cpu", devices=1)
    data = recipe.DataArgs(path=str(tmp_path / "toy"), seq_len=64, batch_size=2)
    tiny = dict(learning_rate=1e-30, min_learning_rate=1e-30)  # updates far below a float32 ulp of the weights
    train = recipe.TrainArgs(max_steps=2, save_interval=2, warmup_steps=0, **tiny)
    recipe.main(fabric, "tiny", tmp_path / "run", 0, data, train, recipe.LogArgs(), False, tmp_path / "hf")
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step-000002", weights_only=False)["model"]
    expected = load_hf_model(tmp_path / "hf").state_dict()
    assert set(saved) == set(expected)
    for name, value in expected.items():
        assert torch.equal(saved[name], value), name


@pytest.mark.parametrize(
    ("folder", "words"),
    [(f"/models/{PLACEHOLDER}/Llama-3.2-1B", "is the config's placeholder"), ("", "is not a Hugging Face checkpoint")],
)
def test_a_placeholder_or_missing_folder_is_a_settings_error(tmp_path, folder, words):
    """The shipped configs hold a placeholder for init_from: a run that keeps it (or names a folder without
    config.json) stops with one settings error naming the setting and what to put there, not a loader traceback."""
    folder = folder or str(tmp_path)  # a folder that exists but holds no checkpoint
    with pytest.raises(SPPOConfigError) as error:
        GPTPretraining(init_from=folder)
    message = str(error.value)
    assert is_settings_error(error.value)
    assert f"model.init_from={folder!r} {words}" in message and "--model.init_from" in message
