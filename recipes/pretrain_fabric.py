"""Pretrain a GPT with SPPO in your own loop: Fabric + a jsonargparse CLI (LitGPT's pretrain style).

    python recipes/pretrain_fabric.py --config configs/fabric-demo-cpu.yaml    # 2 CPU processes, pp=2
    python recipes/pretrain_fabric.py --config configs/fabric-demo-cpu.yaml --train.max_steps 600 --resume true
    python recipes/pretrain_fabric.py --help
    python recipes/pretrain_fabric.py --config configs/fabric-demo-cpu.yaml --init_from /models/Llama-3.2-1B \
        --model_overrides '{"block_size": 1048576}'    # continue a Hugging Face checkpoint (not when resuming)

The step is the one the `sppo` CLI runs (same model initialisation, data order, AdamW and schedule), so
the demo gives the CLI's loss curve. Logs go to CSV (``out_dir/metrics.csv``, one row per step) and, if asked,
W&B (offline without an API key; a resume continues the same run); checkpoints to
``out_dir/checkpoints/step-XXXXXX`` every ``save_interval`` steps and at the end (atomic, the newest ``keep``
kept). A checkpoint holds the data loader's position: ``--resume true`` continues from the newest complete
checkpoint with exactly the batches, and so the losses, of a run that was never interrupted. SIGINT (Ctrl-C) and
SIGTERM stop it as they stop ``sppo fit``: after the step in flight, with a checkpoint of it on every rank, one line
and exit status 130 or 143 (``lightning_sppo.training.stop``); it ends in ``sppo fit``'s order (``shutdown``).
"""

from __future__ import annotations

import csv
import math
import os
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from jsonargparse import CLI
from lightning.fabric import Fabric

from lightning_sppo import GPT, GPTConfig, SPPOConfigError, SPPOStrategy
from lightning_sppo.data import TokenDataModule
from lightning_sppo.errors import config_errors
from lightning_sppo.model.hf import check_hf_shapes, hf_model_config, load_hf_weights
from lightning_sppo.strategy.checkpoint import newest_complete_checkpoint, remove_path
from lightning_sppo.training.cli import wandb_run_id
from lightning_sppo.training.failures import exit_on_failure, watch_peers
from lightning_sppo.training.optim import apply_settings, build_adamw, warmup_cosine
from lightning_sppo.training.shutdown import shut_down
from lightning_sppo.training.stop import STOP, end_of_run, requeue_signal, signals_stop_the_run


@dataclass
class DataArgs:
    path: str = "data/demo"
    """Token file written by sppo-prepare."""
    seq_len: int = 256
    """Tokens per sequence."""
    batch_size: int = 4
    """Sequences per step on each data-parallel replica."""
    packing: bool = False
    """Concatenate documents into full windows."""
    document_mask: bool = True
    """With packing, train every document alone (attention and positions inside it); False: attend across."""
    seed: int = 1337
    """Seeds the document order, the held-out split and the sampler."""
    val_fraction: float = 0.0
    """Share of the documents held out for validation (never trained on); 0: no validation."""


@dataclass
class TrainArgs:
    max_steps: int = 300
    """Optimizer steps."""
    learning_rate: float = 3e-3
    min_learning_rate: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0
    """Clip the global gradient norm; 0 disables."""
    save_interval: int = 50
    """Steps between checkpoints (and one at the end)."""
    keep: int = 2
    """Checkpoints kept (the newest)."""
    val_interval: int = 50
    """Steps between validations of the held-out documents (``data.val_fraction``)."""


@dataclass
class LogArgs:
    interval: int = 10
    """Steps between printed lines (every step goes to the CSV)."""
    wandb_project: str | None = None
    """W&B project; None disables W&B."""


def setup(
    model_name: str = "tiny",
    out_dir: Path = Path("runs/fabric-demo"),
    accelerator: str = "cpu",
    devices: int = 2,
    num_nodes: int = 1,
    precision: str = "32-true",
    seed: int = 1337,
    strategy: dict[str, Any] | None = None,
    data: DataArgs = DataArgs(),  # noqa: B008 (jsonargparse reads defaults from the signature)
    train: TrainArgs = TrainArgs(),  # noqa: B008
    log: LogArgs = LogArgs(),  # noqa: B008
    resume: bool = False,
    init_from: Path | None = None,
    model_overrides: dict[str, Any] | None = None,
) -> Fabric:
    """Launch Fabric and train; returns the Fabric object. ``strategy`` holds ``SPPOStrategy`` keyword arguments.

    ``init_from``: a local Hugging Face folder (Llama 3.x, Qwen2.5, Qwen3) whose config.json replaces
    ``model_name`` and whose weights training starts from, unless a checkpoint is resumed.
    ``model_overrides``: ``GPTConfig`` fields to change (e.g. ``block_size``).
    """
    fabric = Fabric(
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        precision=precision,
        strategy=SPPOStrategy(**(strategy or {})),
    )
    fabric.launch(main, model_name, Path(out_dir), seed, data, train, log, resume, init_from, model_overrides)
    return fabric


def _model_config(model_name: str, init_from: Path | None, overrides: dict[str, Any]) -> GPTConfig:
    """The preset ``model_name``, or a Hugging Face folder's config.json, with ``overrides``. The folder's config.json
    is compared with its tensors' shapes (safetensors headers) before any rank builds that model: one declaring a
    larger model than its weights is one line, not an allocation of it."""
    if not init_from:
        return GPTConfig.from_name(model_name, **overrides)
    with config_errors():
        check_hf_shapes(init_from, hf_model_config(init_from))
        return hf_model_config(init_from, **overrides)


def main(
    fabric: Fabric, model_name: str, out_dir: Path, seed: int, data: DataArgs, train: TrainArgs, log: LogArgs,
    resume: bool, init_from: Path | None = None, model_overrides: dict[str, Any] | None = None,
) -> list[float]:  # fmt: skip
    watch_peers()  # another rank's failure ends this one too (instead of the process-group timeout)
    fabric.seed_everything(seed)
    overrides = model_overrides or {}
    config = _model_config(model_name, init_from, overrides)
    if data.seq_len > config.block_size:
        raise SPPOConfigError(f"data.seq_len={data.seq_len} is above the model's block_size={config.block_size}.")
    with torch.device("meta"):
        model = GPT(config)  # the strategy allocates and initialises only this rank's stage
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(build_adamw(model.parameters(), train.learning_rate, train.weight_decay,
                                                    train.betas))  # fmt: skip
    factor = partial(warmup_cosine, warmup_steps=train.warmup_steps, max_steps=train.max_steps,
                     learning_rate=train.learning_rate, min_learning_rate=train.min_learning_rate)  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    datamodule = TokenDataModule(
        data.path,
        data.seq_len,
        data.batch_size,
        packing=data.packing,
        seed=data.seed,
        document_mask=data.document_mask,
        val_fraction=data.val_fraction,
    )
    shard = fabric.strategy.distributed_sampler_kwargs
    loader = datamodule.dataloader(shard)
    val_loader = datamodule.validation_dataloader(shard) if datamodule.has_validation else None
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "step": 0, "epoch": 0}
    latest = newest_complete_checkpoint(out_dir / "checkpoints") if resume else None
    if latest is not None:
        fabric.load(latest, state)  # the loader resumes inside its epoch, at the next batch
        # The checkpoint's learning rate, weight decay and betas came back with it: this run's settings apply
        apply_settings(optimizer, scheduler, train.learning_rate, train.weight_decay, train.betas)
        fabric.print(f"resumed from {latest} at step {state['step']}")
    elif init_from:  # each rank reads the tensors of its stage (the GPT, cut in place) and cuts its FSDP shard
        with config_errors():  # a folder that changed since: one line
            load_hf_weights(model.module, init_from)
        fabric.print(f"initialised from {init_from}")
    logger = _Logger(
        fabric, out_dir, log, resumed=latest is not None, config=_settings(fabric, model_name, data, train)
    )
    try:
        return fit(fabric, state, val_loader, out_dir, train, logger)
    finally:
        logger.close()


def fit(fabric: Fabric, state: dict, val_loader, out_dir: Path, train: TrainArgs, logger: _Logger) -> list[float]:
    model, optimizer, scheduler, loader = state["model"], state["optimizer"], state["scheduler"], state["loader"]
    losses: list[float] = []
    # From here a signal stops the run after the step in flight (``STOP.agree`` below), with a checkpoint.
    STOP.arm(requeue_signal(fabric.strategy.cluster_environment))
    while state["step"] < train.max_steps:
        loader.sampler.set_epoch(state["epoch"])  # the Trainer does the same at each epoch start
        for batch in loader:  # after a resume: the rest of the saved epoch
            start = time.perf_counter()
            loss = fabric.strategy.forward_backward(
                model, batch["input_ids"], batch["targets"], batch.get("document_ids")
            )
            if train.max_grad_norm > 0:
                fabric.clip_gradients(model, optimizer, max_norm=train.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            tokens = batch["input_ids"].numel() * fabric.strategy.dims.dp
            elapsed = time.perf_counter() - start
            state["step"] += 1
            stop = STOP.agree()  # every rank, every step: whether any rank was signalled (one host all-reduce)
            val_loss = None
            if val_loader is not None and state["step"] % train.val_interval == 0 and not stop:
                val_loss = validate(fabric, model, val_loader)
            logger.step(state["step"] - 1, loss.item(), scheduler.get_last_lr()[0], tokens / elapsed, val_loss)
            losses.append(loss.item())
            if stop or state["step"] % train.save_interval == 0 or state["step"] == train.max_steps:
                _save(fabric, state, out_dir, train.keep)  # with the loader's position in this epoch
            if stop:
                STOP.stopped(state["step"], str(out_dir / "checkpoints" / f"step-{state['step']:06d}"))
            if stop or state["step"] >= train.max_steps:
                return losses
        state["epoch"] += 1
    return losses


def validate(fabric: Fabric, model, loader) -> float:
    """Mean loss per valid target over every held-out sample (the strategy's forward-only pass)."""
    total = count = 0.0
    for batch in loader:
        batch_total, batch_count = fabric.strategy.evaluate(
            model, batch["input_ids"], batch["targets"], batch.get("document_ids")
        )
        total, count = total + batch_total.item(), count + batch_count.item()
    return total / max(count, 1.0)


def _save(fabric: Fabric, state: dict, out_dir: Path, keep: int) -> None:
    fabric.save(out_dir / "checkpoints" / f"step-{state['step']:06d}", state)  # written atomically
    if fabric.global_rank == 0:
        for old in sorted((out_dir / "checkpoints").glob("step-*"))[:-keep]:
            remove_path(old)  # only after the new one is complete
    fabric.barrier()


def _settings(fabric: Fabric, model_name: str, data: DataArgs, train: TrainArgs) -> dict[str, Any]:
    dims = fabric.strategy.dims
    return {
        "model_name": model_name,
        "data": asdict(data),
        "train": asdict(train),
        "strategy": {k: v for k, v in vars(fabric.strategy.config).items()},
        "layout": {"pp": dims.pp, "dp": dims.dp, "sp": dims.sp, "world_size": fabric.world_size},
    }


class _Logger:
    """Every step to CSV (and W&B when configured) on rank 0; a line to stdout every ``interval`` steps."""

    COLUMNS = ["step", "loss", "lr", "tokens_per_s", "tokens_per_gpu_per_s", "val_loss", "val_ppl"]

    def __init__(self, fabric: Fabric, out_dir: Path, log: LogArgs, resumed: bool, config: dict[str, Any]) -> None:
        self.fabric, self.log = fabric, log
        self.file = self.writer = self.wandb = None
        if fabric.global_rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.file = (out_dir / "metrics.csv").open("a", newline="")
        self.writer = csv.writer(self.file)
        if self.file.tell() == 0:
            self.writer.writerow(self.COLUMNS)
        if log.wandb_project:
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline" if "WANDB_API_KEY" not in os.environ else "online")
            run_id = wandb_run_id(out_dir, resumed)  # a resume continues the same W&B run
            self.wandb = wandb.init(project=log.wandb_project, dir=str(out_dir), id=run_id, resume="allow",
                                    config=config | {"log": asdict(log)})  # fmt: skip

    def step(self, step: int, loss: float, lr: float, tokens_per_s: float, val_loss: float | None) -> None:
        per_gpu = tokens_per_s / self.fabric.world_size
        val_ppl = None if val_loss is None else math.exp(min(val_loss, 709.0))
        if self.writer is not None:
            self.writer.writerow([step, loss, lr, tokens_per_s, per_gpu, val_loss, val_ppl])
            self.file.flush()  # a crash keeps every finished step's row
        if self.wandb is not None:
            metrics = {"train/loss": loss, "train/lr": lr, "perf/tokens_per_s": tokens_per_s}
            if val_loss is not None:
                metrics |= {"val/loss": val_loss, "val/ppl": val_ppl}
            self.wandb.log(metrics, step=step)
        if step % self.log.interval == 0 or val_loss is not None:
            line = f"step {step:5d}  loss {loss:.4f}  lr {lr:.2e}  tokens/s {tokens_per_s:,.0f}"
            self.fabric.print(line + ("" if val_loss is None else f"  val/loss {val_loss:.4f}"))

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def run() -> None:
    """The command: train, then end in a fixed order with the status of how the run stopped."""
    with signals_stop_the_run("pretrain_fabric", resume="--resume true"), exit_on_failure(program="pretrain_fabric"):
        fabric = CLI(setup, as_positional=False)
        end_of_run(shut_down(fabric.strategy.launcher))


if __name__ == "__main__":
    run()
