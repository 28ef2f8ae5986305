"""GPT pretraining as a LightningModule with manual optimisation: the strategy runs every subsequence."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_sppo.errors import NonFiniteError, SPPOConfigError
from lightning_sppo.loss import IGNORE_INDEX
from lightning_sppo.model import GPT
from lightning_sppo.runtime.stage import StageModule
from lightning_sppo.training.model_source import load_initial_weights, model_config, start_line, vocabulary_error
from lightning_sppo.training.optim import apply_settings, build_adamw, warmup_cosine

__all__ = ["GPTPretraining"]


class GPTPretraining(L.LightningModule):
    """Next-token pretraining of a ``lightning_sppo.GPT`` with AdamW and a warm-up + cosine schedule.

    Args:
        model: a ``GPTConfig.from_name`` name ("gpt-7b", "llama-3.1-8b", "tiny", ...); ignored with ``init_from``.
        model_overrides: ``GPTConfig`` fields to change, e.g. ``{"block_size": 1048576}``.
        init_from: where training starts from. A local Hugging Face checkpoint folder (Llama 3.x, Qwen2.5, Qwen3):
            the model is its config.json (with ``model_overrides`` on top) and its weights. Or a checkpoint of
            this project: its architecture (``model_config``) and its weights only, with a fresh optimizer,
            schedule, step count and data order (``ckpt_path`` resumes all of them instead). Each rank loads the
            weights of its own stage at fit start; not when resuming from a checkpoint.
        learning_rate: peak learning rate.
        min_learning_rate: the cosine schedule's floor.
        warmup_steps: linear warm-up steps.
        max_steps: steps of the cosine decay (usually ``trainer.max_steps``).
        weight_decay: AdamW weight decay (not applied to norms and biases).
        betas: AdamW betas.
        max_grad_norm: clip the global gradient norm (across every stage and shard); 0 disables.
        stop_on_nonfinite: stop with ``NonFiniteError`` when a step's loss or gradient norm is not finite, before
            the optimizer applies it (no checkpoint is written for that step, so the last good one is kept).
            False trains on (a checkpoint callback still skips non-finite steps).

    Validation (when the data module has a validation set) runs the strategy's forward-only subsequence pass
    and logs ``val/loss``, the token-weighted mean loss over the whole validation set and every data-parallel
    rank, and ``val/ppl = exp(val/loss)``.
    """

    def __init__(
        self,
        model: str = "tiny",
        model_overrides: dict[str, Any] | None = None,
        learning_rate: float = 3e-4,
        min_learning_rate: float = 3e-5,
        warmup_steps: int = 100,
        max_steps: int = 10_000,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        max_grad_norm: float = 1.0,
        init_from: str | None = None,
        stop_on_nonfinite: bool = True,
    ) -> None:
        super().__init__()
        _check_optimisation(learning_rate, min_learning_rate, warmup_steps, weight_decay, betas, max_grad_norm)
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.config = model_config(model, model_overrides, init_from)
        self.model: torch.nn.Module | None = None
        self.announce = True
        """Whether the run's first line (``model_source.start_line``) is this module's to print: ``sppo`` prints it
        itself, before anything else, and sets this False."""
        self._val_sums = [0.0, 0.0]  # summed token loss, valid targets (float64 on the host)

    @classmethod
    @override
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> GPTPretraining:
        """Refused before the file is read: Lightning's loader reads it with PyTorch's defaults, not as data only
        (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` in the environment, or an ``http`` URL, runs a pickle's code), and
        this module's model is built on the meta device for the SPPO strategy to place, so the weights would not
        load into it anyway."""
        raise NotImplementedError(
            f"GPTPretraining.load_from_checkpoint({str(checkpoint_path)!r}) is not supported (it would read the file"
            " with Lightning's loader, not as data only); resume with `sppo fit --ckpt_path`, evaluate with `sppo"
            " validate --ckpt_path`, start from its weights with `--model.init_from`, or in Python build the plain"
            " model: lightning_sppo.model.export.read_checkpoint(path) gives its state dict (docs/checkpoints.md)."
        )

    def setup(self, stage: str) -> None:
        """Fail before training when the data cannot feed this model (each rank checks, nothing is sent)."""
        from lightning_sppo.strategy.trainer import SPPOTrainerStrategy

        strategy = self.trainer.strategy
        if not isinstance(strategy, SPPOTrainerStrategy):
            raise SPPOConfigError(
                f"trainer.strategy is {type(strategy).__name__}, but GPTPretraining builds its model on the meta"
                " device for the SPPO strategy to place; set trainer.strategy: sppo (or leave it out: sppo is the"
                " default), with its settings under trainer.strategy.init_args."
            )
        datamodule = getattr(self.trainer, "datamodule", None)
        seq_len = getattr(datamodule, "seq_len", None)
        if seq_len is not None and seq_len > self.config.block_size:
            raise SPPOConfigError(
                f"data.seq_len={seq_len} is above the model's block_size={self.config.block_size}; lower"
                " data.seq_len or raise model.model_overrides.block_size."
            )
        token_file = getattr(getattr(datamodule, "train_dataset", None), "token_file", None)
        vocab_size = getattr(token_file, "vocab_size", None)
        if vocab_size is not None and vocab_size > self.config.vocab_size:
            path = str(getattr(datamodule, "path", getattr(token_file, "path", "")))
            raise SPPOConfigError(vocabulary_error(path, vocab_size, self.config, self.hparams.init_from))

    def configure_model(self) -> None:
        """Built on the meta device: the strategy allocates only this rank's stage, then initialises it."""
        if self.model is None:
            with torch.device("meta"):
                self.model = GPT(self.config)

    @override
    def on_fit_start(self) -> None:
        """Pretrained weights into this rank's (cut, sharded) model. Runs after the strategy's ``setup``. A resumed
        run skips it: before ``setup`` (most strategies) the checkpoint is already restored, so loading here would
        overwrite it; ``SPPOTrainerStrategy`` restores after this hook (``trainer.ckpt_path`` is still None then),
        and its restore overwrites these weights."""
        if self.hparams.init_from is not None and self.trainer.ckpt_path is None:
            model = self.model.model if isinstance(self.model, StageModule) else self.model
            load_initial_weights(model, self.hparams.init_from)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("hyper_parameters")  # only to name the settings a resume changes
        self._saved_hparams = dict(saved) if isinstance(saved, dict) else {}

    @override
    def on_train_start(self) -> None:
        """After any restore (``trainer.ckpt_path`` is known): which model trains, from which weights; a resumed
        run's optimizer and schedule take this run's settings (the restore brought back the checkpoint's)."""
        self._say_what_runs()
        if self.trainer.ckpt_path is not None:
            self._apply_optimisation_settings()

    def _apply_optimisation_settings(self) -> None:
        """The learning rate, its schedule, weight decay and betas of ``hparams`` into the restored optimizer and
        schedule: Lightning restores the checkpoint's values, so a resume with ``model.learning_rate`` lowered (what
        ``NonFiniteError`` advises) trained on at the old one, silently. Unchanged settings give the restored values
        bit for bit (the schedule's own formula); changed ones are named in one line."""
        hp, optimizer, scheduler = self.hparams, self.optimizers(), self.lr_schedulers()
        optimizer = getattr(optimizer, "optimizer", optimizer)
        if optimizer is None or not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            return
        apply_settings(optimizer, scheduler, hp.learning_rate, hp.weight_decay, hp.betas)
        saved = getattr(self, "_saved_hparams", {})
        names = ("learning_rate", "min_learning_rate", "warmup_steps", "max_steps", "weight_decay", "betas")
        changed = [n for n in names if n in saved and _as_list(saved[n]) != _as_list(hp[n])]
        if changed:
            said = ", ".join(f"model.{n}={_as_list(hp[n])!r} (was {_as_list(saved[n])!r})" for n in changed)
            rank_zero_info(f"Resumed with other settings than the checkpoint's: {said}; the optimizer and the"
                           " learning-rate schedule follow the new values from this step on.")  # fmt: skip

    @override
    def on_validation_start(self) -> None:
        if self.trainer.state.fn == "validate":  # `sppo validate`: no training start
            self._say_what_runs()

    def _say_what_runs(self) -> None:
        if not self.announce:
            return
        hp, path = self.hparams, self.trainer.ckpt_path
        rank_zero_info(start_line(self.config, hp.model, hp.model_overrides, hp.init_from, path and str(path)))

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The architecture in every checkpoint, so ``sppo-export`` needs nothing else (the strategy on several
        devices records the same in its folder's ``meta.pt``)."""
        checkpoint["model_config"] = self.config.to_dict()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        input_ids, targets = batch["input_ids"], batch["targets"]
        document_ids = batch.get("document_ids")  # packed documents, each trained alone (TokenDataModule)
        strategy = self.trainer.strategy
        if hasattr(strategy, "forward_backward"):
            loss = strategy.forward_backward(self.model, input_ids, targets, document_ids)
        else:  # any other strategy: the plain full-sequence step, for comparison
            logits = self.model(input_ids, document_ids)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)
            self.manual_backward(loss)
            loss = loss.detach()
        self._check_finite(loss)
        if self.hparams.max_grad_norm > 0:
            norm = self._clip(optimizer)
            self._check_finite(loss, norm)
            self.log("train/grad_norm", norm, on_step=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.lr_schedulers().step()
        # The loss and the norm are the same on every rank (the strategy reduces them), so every rank logs them:
        # callbacks that monitor a metric (ModelCheckpoint(monitor=...), EarlyStopping) run on every rank.
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        self.log("train/lr", optimizer.param_groups[0]["lr"], on_step=True)
        return loss

    def _check_finite(self, loss: Tensor, norm: Tensor | None = None) -> None:
        """Stop before a non-finite step is applied. The loss and the norm are global (the same on every rank),
        so every rank stops at the same step."""
        if not self.hparams.stop_on_nonfinite:
            return
        values = torch.stack([loss.float(), loss.new_zeros((), dtype=torch.float32) if norm is None else norm.float()])
        if torch.isfinite(values).all():  # one host sync per step
            return
        what = f"train/loss={loss.item():.4g}" + ("" if norm is None else f" and gradient norm={norm.item():.4g}")
        raise NonFiniteError(
            f"Training diverged at step {self.global_step}: {what}. The step was not applied and nothing was saved"
            " for it, so the newest checkpoint is the last good state. Lower model.learning_rate (or keep"
            " model.max_grad_norm > 0) and resume with --ckpt_path last; model.stop_on_nonfinite=false trains on."
        )

    def _clip(self, optimizer: Any) -> Tensor:
        strategy = self.trainer.strategy
        if hasattr(strategy, "clip_gradients"):
            return strategy.clip_gradients(optimizer.optimizer, self.hparams.max_grad_norm, error_if_nonfinite=False)
        return torch.nn.utils.clip_grad_norm_(self.parameters(), self.hparams.max_grad_norm)

    def on_validation_epoch_start(self) -> None:
        self._val_sums = [0.0, 0.0]

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Sums the token losses and valid targets of the global batch (the strategy's forward-only pass)."""
        input_ids, targets = batch["input_ids"], batch["targets"]
        document_ids = batch.get("document_ids")  # packed documents, each evaluated alone
        strategy = self.trainer.strategy
        if hasattr(strategy, "evaluate"):
            total, count = strategy.evaluate(self.model, input_ids, targets, document_ids)
        else:  # any other strategy: the plain full-sequence forward of this process's batch
            logits = self.model(input_ids, document_ids)
            total = F.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            count = (targets != IGNORE_INDEX).sum()
        self._val_sums[0] += total.item()
        self._val_sums[1] += count.item()

    def on_validation_epoch_end(self) -> None:
        total, count = self._val_sums
        if count == 0 or self.trainer.sanity_checking:
            return
        loss = total / count  # token-weighted over the whole validation set: the sums are global already
        # The same on every rank: "max" over ranks is exact (and keeps Lightning from asking for a sync).
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, reduce_fx="max")
        self.log("val/ppl", math.exp(loss) if loss < 709 else math.inf, sync_dist=True, reduce_fx="max")

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = build_adamw(self.parameters(), hp.learning_rate, hp.weight_decay, hp.betas)
        factor = partial(warmup_cosine, warmup_steps=hp.warmup_steps, max_steps=hp.max_steps,
                         learning_rate=hp.learning_rate, min_learning_rate=hp.min_learning_rate)  # fmt: skip
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def _check_optimisation(
    learning_rate: float,
    min_learning_rate: float,
    warmup_steps: int,
    weight_decay: float,
    betas: tuple[float, float],
    max_grad_norm: float,
) -> None:
    """One line naming the first optimisation setting that cannot work (before torch's own multi-line errors)."""
    problems = [
        (not learning_rate > 0, f"model.learning_rate must be positive, got {learning_rate}; e.g. 3e-4"),
        (
            not 0 <= min_learning_rate <= learning_rate,
            f"model.min_learning_rate must be in [0, model.learning_rate={learning_rate}], got {min_learning_rate};"
            f" e.g. {learning_rate / 10:g}",
        ),
        (not warmup_steps >= 0, f"model.warmup_steps must be >= 0, got {warmup_steps}; e.g. 100"),
        (not weight_decay >= 0, f"model.weight_decay must be >= 0, got {weight_decay}; e.g. 0.1"),
        (
            len(betas) != 2 or not all(0 <= b < 1 for b in betas),
            f"model.betas must be two numbers in [0, 1), got {list(betas)}; e.g. [0.9, 0.95]",
        ),
        (
            not max_grad_norm >= 0,
            f"model.max_grad_norm must be >= 0 (0 disables clipping), got {max_grad_norm}; e.g. 1.0",
        ),
    ]
    for failed, message in problems:
        if failed:
            raise SPPOConfigError(message + ".")
