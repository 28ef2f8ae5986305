"""Trainer(strategy="sppo") on one CPU device, in process: the module trains through forward_backward."""

import warnings

import torch
from lightning.pytorch import Trainer

from lightning_sppo import SPPOTrainerStrategy
from lightning_sppo.data import TokenDataModule, write_tokens
from lightning_sppo.training import GPTPretraining


def test_trainer_on_one_device_runs_subsequences_and_learns(tmp_path):
    torch.manual_seed(0)
    text = b"the quick brown fox jumps over the lazy dog. " * 40
    write_tokens(tmp_path / "toy", [list(text)], vocab_size=256, tokenizer="bytes")
    strategy = SPPOTrainerStrategy(num_subsequences=3, partition="flops")
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=25, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = GPTPretraining(model="tiny", learning_rate=3e-3, warmup_steps=2, max_steps=25, weight_decay=0.0)
    losses = []

    original = module.training_step

    def training_step(batch, batch_idx):
        loss = original(batch, batch_idx)
        losses.append(loss.item())
        return loss

    module.training_step = training_step
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.warn("a genuine warning", UserWarning, stacklevel=1)
        trainer.fit(module, TokenDataModule(tmp_path / "toy", seq_len=64, batch_size=2))
    # The strategy's set-up hides torch's LeafSpec deprecation raised by Lightning's fit loop, nothing else.
    assert not [w for w in seen if "LeafSpec" in str(w.message)], [str(w.message) for w in seen]
    assert "a genuine warning" in [str(w.message) for w in seen]
    assert trainer.global_step == 25
    assert len(strategy.core.last_plan.lengths) == 3  # the step ran as 3 subsequences
    assert losses[-1] < losses[0] - 1.0, losses


def test_the_demo_config_packed_trains_with_document_masking():
    """The demo's model and data (configs/demo-cpu.yaml) with data.packing: true: every step gets document_ids,
    some windows hold two documents, and the loss falls. Windows of 1024 tokens (the demo's documents are ~8K
    tokens: at its 256 few windows would cross a boundary in a short run)."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    demo = yaml.safe_load((root / "configs" / "demo-cpu.yaml").read_text())
    data = demo["data"] | {"path": root / "data" / "demo", "packing": True, "seq_len": 1024}
    torch.manual_seed(0)
    strategy = SPPOTrainerStrategy(num_subsequences=4, partition="flops")
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=12, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = GPTPretraining(model=demo["model"]["model"], learning_rate=3e-3, warmup_steps=2, max_steps=12)
    seen, losses = [], []
    forward_backward = strategy.forward_backward

    def spy(model, input_ids, targets, document_ids=None):
        seen.append(document_ids)
        loss = forward_backward(model, input_ids, targets, document_ids)
        losses.append(loss.item())
        return loss

    strategy.forward_backward = spy
    trainer.fit(module, TokenDataModule(**data))
    assert len(seen) == 12 and all(d is not None and d.shape == (data["batch_size"], data["seq_len"]) for d in seen)
    assert any(int(d.max()) > 0 for d in seen), "no window held a document boundary"
    assert losses[-1] < losses[0] - 0.5, losses
