"""What the ``sppo`` command settles before it builds anything (``run_checks``), the line a run starts with
(``model_source.start_line``), the progress bar's title and where the strategy leaves ``document_ids``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import RichProgressBar

from lightning_sppo import SPPOTrainerStrategy
from lightning_sppo.errors import SPPOConfigError
from lightning_sppo.model import GPTConfig
from lightning_sppo.training import run_checks
from lightning_sppo.training.model_source import model_config, start_line
from lightning_sppo.training.progress import SPPOProgressBar


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_one_cpu_thread_per_process_unless_omp_num_threads_says(threads):
    torch.set_num_threads(2)
    assert run_checks.cpu_threads(Namespace(accelerator="cpu"), environ={"OMP_NUM_THREADS": "2"}) is None
    assert torch.get_num_threads() == 2  # the user's choice stands
    assert run_checks.cpu_threads(Namespace(accelerator="cpu"), environ={}) == 1
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    assert run_checks.cpu_threads(Namespace(accelerator="gpu"), environ={}) is None  # a GPU run keeps torch's
    assert torch.get_num_threads() == 2


def test_tf32_only_with_mixed_precision_on_a_gpu(monkeypatch):
    before = torch.get_float32_matmul_precision()
    try:
        assert run_checks.float32_matmul_precision(Namespace(precision="bf16-mixed", accelerator="auto")) is None
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
        torch.set_float32_matmul_precision("highest")
        assert run_checks.float32_matmul_precision(Namespace(precision="32-true", accelerator="auto")) is None
        assert torch.get_float32_matmul_precision() == "highest"  # float32 training keeps full precision
        assert run_checks.float32_matmul_precision(Namespace(precision="bf16-mixed", accelerator="gpu")) == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_resume_may_change_block_size_only():
    tiny = GPTConfig.from_name("tiny")
    assert run_checks.architecture_difference(tiny, GPTConfig.from_name("tiny", block_size=8192)) == []
    assert run_checks.architecture_difference(tiny, GPTConfig.from_name("tiny", rope_base=5e5)) == ["rope_base"]
    assert "n_layer" in run_checks.architecture_difference(tiny, GPTConfig.from_name("small"))


def test_the_start_line_says_which_architecture_and_which_weights():
    tiny = model_config("tiny", None, None)
    assert start_line(tiny, "tiny", None, None, None) == (
        "Model: 'tiny' (0.2M parameters, 2 layers, n_embd=64), architecture from model.model='tiny'; weights from a"
        " random initialisation (seed_everything)."
    )
    line = start_line(tiny, "llama-3.2-1b", {"block_size": 8192}, "/models/x", "runs/a/last.ckpt")
    assert "architecture from model.init_from (config.json of /models/x); model.model='llama-3.2-1b' is ignored" in line
    assert "model.model_overrides {'block_size': 8192}" in line and "the checkpoint runs/a/last.ckpt (resumed)" in line


def test_model_settings_errors_name_the_setting():
    with pytest.raises(SPPOConfigError, match="model.model='tinny' is not a registered model; did you mean 'tiny'"):
        model_config("tinny", None, None)
    with pytest.raises(SPPOConfigError, match="model.model_overrides has no field 'n_layr'.*did you mean 'n_layer'"):
        model_config("tiny", {"n_layr": 3}, None)
    with pytest.raises(SPPOConfigError, match=r"model.model_overrides=\{'n_head': 3\}: GPTConfig.n_head must be"):
        model_config("tiny", {"n_head": 3}, None)


@pytest.mark.parametrize(
    ("devices", "nodes", "accelerator", "world"),
    [(3, 1, "cpu", 3), ("2", 2, "cpu", 4), ([0, 1], 1, "gpu", 2), ("0,1,2", 1, "gpu", 3), ("auto", 1, "cpu", 1),
     ("auto", 1, "gpu", None), (-1, 1, "gpu", None), (2, "x", "cpu", None)],
)  # fmt: skip
def test_the_world_size_the_trainer_settings_ask_for(devices, nodes, accelerator, world):
    trainer = Namespace(devices=devices, num_nodes=nodes, accelerator=accelerator)
    assert run_checks.world_size(trainer) == world


def test_the_layout_is_checked_against_the_model_before_anything_starts():
    """3 processes, pp=2 and a 2-layer model: the one value that runs is named (pp=3 was advised, and failed)."""
    tiny = GPTConfig.from_name("tiny")
    strategy = Namespace(class_path="lightning_sppo.SPPOTrainerStrategy", init_args=Namespace(pipeline_parallel=2))
    trainer = Namespace(devices=3, num_nodes=1, accelerator="cpu", strategy=strategy)
    with pytest.raises(SPPOConfigError) as error:
        run_checks.check_layout(trainer, tiny)
    assert "trainer.strategy.init_args:" in str(error.value) and "(the model has 2 layers): [1]" in str(error.value)
    strategy.init_args.pipeline_parallel = 1
    run_checks.check_layout(trainer, tiny)  # the advice passes
    strategy.init_args.pipeline_parallel = None
    run_checks.check_layout(trainer, tiny)  # left to the planner: not checked here


def test_model_overrides_may_not_reshape_init_from_s_weights(monkeypatch):
    base = GPTConfig.from_name("tiny")
    monkeypatch.setattr("lightning_sppo.training.model_source._init_from_config", lambda path: base)
    assert model_config("tiny", {"block_size": 8192, "rope_base": 5e5}, "hf").block_size == 8192  # no weight moves
    with pytest.raises(SPPOConfigError, match=r"vocab_size: 256 -> 512 would reshape.*Remove vocab_size from"):
        model_config("tiny", {"vocab_size": 512, "block_size": 8192}, "hf")
    with pytest.raises(SPPOConfigError, match=r"Remove n_layer from model.model_overrides, or remove model.init_from"):
        model_config("tiny", {"n_layer": 3}, "hf")
    assert model_config("tiny", {"vocab_size": 512}, None).vocab_size == 512  # without init_from: any architecture
    before = torch.random.get_rng_state()
    model_config("tiny", {"block_size": 8192}, "hf")
    assert torch.equal(torch.random.get_rng_state(), before)  # checking shapes draws no seed


def test_the_progress_bar_reads_right_when_steps_bound_training():
    """Lightning's bar titles "Epoch 0/-2" with max_epochs -1 (the negative control); ours "Epoch 0"."""
    trainer = SimpleNamespace(max_epochs=-1)
    ours, lightnings = SPPOProgressBar(), RichProgressBar()
    for bar in (ours, lightnings):
        bar._trainer = trainer
    assert lightnings._get_train_description(0).strip() == "Epoch 0/-2"
    assert ours._get_train_description(0).strip() == "Epoch 0"
    trainer.max_epochs = 3
    assert ours._get_train_description(1).strip() == "Epoch 1/2"


def test_the_strategy_leaves_document_ids_on_the_host():
    """Moved by the strategy (not the LightningModule's transfer_batch_to_device, which Lightning warns about)."""
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "document_ids": torch.zeros(1, 4, dtype=torch.long)}
    moved = SPPOTrainerStrategy().batch_to_device(batch, torch.device("meta"))
    assert moved["input_ids"].device.type == "meta" and moved["document_ids"].device.type == "cpu"
    assert SPPOTrainerStrategy().batch_to_device({"x": torch.zeros(1)}, torch.device("meta"))["x"].is_meta
