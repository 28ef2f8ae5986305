"""Pretrain a GPT with SPPO in your own loop: Fabric + a jsonargparse CLI (LitGPT's pretrain style).

    python recipes/pretrain_fabric.py --config configs/fabric-demo-cpu.yaml    # 2 CPU processes, pp=2
    python recipes/pretrain_fabric.py --config configs/fabric-demo-cpu.yaml --train.max_steps 20
    python recipes/pretrain_fabric.py --help
    python recipes/pretrain_fabric.py --config configs/fabric-demo-cpu.yaml --init_from /models/Llama-3.2-1B \
        --model_overrides '{"block_size": 1048576}'    # continue a Hugging Face checkpoint (not when resuming)

The step is the one the `sppo` CLI runs (same model initialisation, data order, AdamW and schedule), so
the demo gives the CLI's loss curve. Logs go to CSV (``out_dir/metrics.csv``) and, if asked, W&B (offline
without an API key); checkpoints to ``out_dir/checkpoints/step-XXXXXX`` (atomic, the last ``keep`` kept).
"""

from __future__ import annotations

import csv
import os
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from jsonargparse import CLI
from lightning.fabric import Fabric

from lightning_sppo import GPT, GPTConfig, SPPOStrategy
from lightning_sppo.data import TokenDataModule
from lightning_sppo.model.hf import hf_model_config, load_hf_weights
from lightning_sppo.training.optim import build_adamw, warmup_cosine


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
    """Seeds the document order and the sampler."""


@dataclass
class TrainArgs:
    max_steps: int = 300
    """Optimizer steps."""
    batches_per_epoch: int = 50
    """Batches per pass before the sampler reshuffles (the CLI's ``trainer.limit_train_batches``)."""
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
) -> None:
    """Launch Fabric and train. ``strategy`` holds ``SPPOStrategy`` keyword arguments.

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


def main(
    fabric: Fabric, model_name: str, out_dir: Path, seed: int, data: DataArgs, train: TrainArgs, log: LogArgs,
    resume: bool, init_from: Path | None = None, model_overrides: dict[str, Any] | None = None,
) -> list[float]:  # fmt: skip
    fabric.seed_everything(seed)
    overrides = model_overrides or {}
    config = hf_model_config(init_from, **overrides) if init_from else GPTConfig.from_name(model_name, **overrides)
    if data.seq_len > config.block_size:
        raise ValueError(f"data.seq_len={data.seq_len} is above the model's block_size={config.block_size}.")
    with torch.device("meta"):
        model = GPT(config)  # the strategy allocates and initialises only this rank's stage
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(build_adamw(model.parameters(), train.learning_rate, train.weight_decay,
                                                    train.betas))  # fmt: skip
    factor = partial(warmup_cosine, warmup_steps=train.warmup_steps, max_steps=train.max_steps,
                     learning_rate=train.learning_rate, min_learning_rate=train.min_learning_rate)  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    latest = _checkpoints(out_dir)[-1:] if resume else []
    if latest:
        fabric.load(latest[0], state)
        fabric.print(f"resumed from {latest[0]} at step {state['step']}")
    elif init_from:  # each rank reads the tensors of its stage (the GPT, cut in place) and cuts its FSDP shard
        load_hf_weights(model.module, init_from)
        fabric.print(f"initialised from {init_from}")
    loader = TokenDataModule(
        data.path, data.seq_len, data.batch_size, packing=data.packing, seed=data.seed, document_mask=data.document_mask
    ).dataloader(fabric.strategy.distributed_sampler_kwargs)
    return fit(fabric, state, loader, out_dir, train, log)


def fit(fabric: Fabric, state: dict, loader, out_dir: Path, train: TrainArgs, log: LogArgs) -> list[float]:
    model, optimizer, scheduler = state["model"], state["optimizer"], state["scheduler"]
    logger = _Logger(fabric, out_dir, log)
    losses: list[float] = []
    while state["step"] < train.max_steps:
        epoch = state["step"] // train.batches_per_epoch
        loader.sampler.set_epoch(epoch)  # the Trainer does the same at each epoch start
        skip = state["step"] - epoch * train.batches_per_epoch  # resuming inside an epoch
        for index, batch in enumerate(loader):
            if index < skip:
                continue
            if index >= train.batches_per_epoch or state["step"] >= train.max_steps:
                break
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
            logger.step(state["step"], loss.item(), scheduler.get_last_lr()[0], tokens / (time.perf_counter() - start))
            losses.append(loss.item())
            state["step"] += 1
            if state["step"] % train.save_interval == 0 or state["step"] == train.max_steps:
                _save(fabric, state, out_dir, train.keep)
    logger.close()
    return losses


def _checkpoints(out_dir: Path) -> list[Path]:
    return sorted((out_dir / "checkpoints").glob("step-*"))


def _save(fabric: Fabric, state: dict, out_dir: Path, keep: int) -> None:
    fabric.save(out_dir / "checkpoints" / f"step-{state['step']:06d}", state)  # written atomically
    if fabric.global_rank == 0:
        from lightning_sppo.strategy.checkpoint import remove_path

        for old in _checkpoints(out_dir)[:-keep]:
            remove_path(old)
    fabric.barrier()


class _Logger:
    """Every step to CSV (and W&B when configured) on rank 0; a line to stdout every ``interval`` steps."""

    def __init__(self, fabric: Fabric, out_dir: Path, log: LogArgs) -> None:
        self.fabric, self.log = fabric, log
        self.file = self.writer = self.wandb = None
        if fabric.global_rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.file = (out_dir / "metrics.csv").open("a", newline="")
        self.writer = csv.writer(self.file)
        if self.file.tell() == 0:
            self.writer.writerow(["step", "loss", "lr", "tokens_per_s", "tokens_per_gpu_per_s"])
        if log.wandb_project:
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline" if "WANDB_API_KEY" not in os.environ else "online")
            self.wandb = wandb.init(project=log.wandb_project, dir=str(out_dir), config={"log": asdict(log)})

    def step(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        per_gpu = tokens_per_s / self.fabric.world_size
        if self.writer is not None:
            self.writer.writerow([step, loss, lr, tokens_per_s, per_gpu])
        if self.wandb is not None:
            self.wandb.log({"train/loss": loss, "train/lr": lr, "perf/tokens_per_s": tokens_per_s}, step=step)
        if step % self.log.interval == 0:
            self.fabric.print(f"step {step:5d}  loss {loss:.4f}  lr {lr:.2e}  tokens/s {tokens_per_s:,.0f}")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


if __name__ == "__main__":
    CLI(setup, as_positional=False)
