"""Bad inputs to every command, as a table: what each must end with (exit status, one line, the setting named).

Run by ``test_bad_inputs.py`` (all cases in one process: one import of torch and Lightning), or alone to print
the table (``python tests/training/bad_inputs.py``), e.g. against another checkout of the package by putting it
first on ``PYTHONPATH``. Each case runs the function a console script calls (``sppo``, ``sppo-export``,
``sppo-prepare``, ``sppo-plan``) in a scratch folder, with stdout and stderr captured at the file-descriptor level
(Lightning's log handlers and C++ messages included), or a Fabric user's Python call. The exit-status
convention of all four commands (docs/troubleshooting.md): 0 success, 2 a setting or an input to change (one
``PROG: error: ...`` line), 1 anything else (a bug keeps its traceback; ``sppo-plan``: nothing fits).

Fabric cases have no exit status: they must raise ``SPPOConfigError`` or another ``ValueError`` type of the
package (counted as status 2 here) whose one-line message names the Python argument and no command-line flag.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = {
    "sppo": "lightning_sppo.training.cli:main",
    "sppo-export": "lightning_sppo.model.export:main",
    "sppo-prepare": "lightning_sppo.data.prepare:main",
    "sppo-plan": "lightning_sppo.planner.cli:main",
}

MY_YAML = """\
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
model:
  model: tiny
data:
  path: data/demo
  seq_len: 32
  batch_size: 2
"""
FIT = ("fit", "--config", "my.yaml")
TINY_CKPT = "runs/tiny/checkpoints/epoch=0-step=2.ckpt"


@dataclass
class Case:
    """One bad input: ``args`` to ``program`` (or ``call``, a Fabric user's code), and what it must end with."""

    id: str
    program: str
    args: tuple[str, ...] = ()
    code: int = 2
    """The exit status it must end with."""
    named: tuple[str, ...] = ()
    """Texts the error line must hold: the setting (in the caller's terms), and for some the value or a hint."""
    error_lines: int = 1
    """How many ``PROG: error:`` lines (0 for a case that must succeed, with a message of its own)."""
    call: Callable[[], None] | None = None
    message: str = ""
    """For a case that succeeds: a text its output must hold (what it says)."""
    passed_before: bool = False
    """One of the bad inputs that already gave one line and the right status before issue 32."""
    absent: tuple[str, ...] = ()
    """Texts the error line must not hold (a Fabric user has no command-line flags)."""


@dataclass
class Outcome:
    code: int
    output: str
    error: str = ""
    lines: int = 0
    errors: list[str] = field(default_factory=list)


# -- the Fabric user's calls -----------------------------------------------------------------------------------


def _fabric_step(seq_len: int, num_subsequences, **strategy) -> None:
    import torch
    from lightning.fabric import Fabric

    from lightning_sppo import GPT, GPTConfig, SPPOStrategy

    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=num_subsequences, **strategy), accelerator="cpu", devices=1)
    fabric.launch()
    model, optimizer = fabric.setup(*_model_and_optimizer(GPT(GPTConfig.from_name("tiny")), torch))
    ids = torch.randint(0, 256, (1, seq_len))
    fabric.strategy.forward_backward(model, ids, ids.roll(-1, 1))


def _model_and_optimizer(model, torch):
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _fabric_batch(edit: Callable) -> Callable[[], None]:
    """One step of the tiny model on a batch that ``edit(ids, targets)`` spoils (returns the pair to pass)."""

    def step() -> None:
        import torch
        from lightning.fabric import Fabric

        from lightning_sppo import GPT, GPTConfig, SPPOStrategy

        fabric = Fabric(strategy=SPPOStrategy(num_subsequences=2), accelerator="cpu", devices=1)
        model, _ = fabric.setup(*_model_and_optimizer(GPT(GPTConfig.from_name("tiny")), torch))
        ids = torch.randint(0, 256, (1, 64))
        fabric.strategy.forward_backward(model, *edit(ids, ids.roll(-1, 1)))

    return step


def _set(tensor, value):
    tensor[0, 5] = value
    return tensor


def _fabric_load_other_model() -> None:
    import torch
    from lightning.fabric import Fabric

    from lightning_sppo import GPT, GPTConfig, SPPOStrategy

    fabric = Fabric(strategy=SPPOStrategy(num_subsequences=2), accelerator="cpu", devices=1)
    small, optimizer = fabric.setup(*_model_and_optimizer(GPT(GPTConfig.from_name("tiny-gqa")), torch))
    del optimizer
    fabric.load("fabric-tiny.pt", {"model": small})


def _fabric_strategy(**settings) -> Callable[[], None]:
    def build() -> None:
        from lightning_sppo import SPPOStrategy

        SPPOStrategy(**settings)

    return build


# -- the cases -------------------------------------------------------------------------------------------------


def _fit(*args: str) -> tuple[str, ...]:
    return (*FIT, *args)


# fmt: off
CASES: list[Case] = [
    # sppo fit: the data settings
    Case("fit-seq-len-0", "sppo", _fit("--data.seq_len", "0"), named=("data.seq_len",)),
    Case("fit-seq-len-negative", "sppo", _fit("--data.seq_len", "-3"), named=("data.seq_len",)),
    Case("fit-seq-len-text", "sppo", _fit("--data.seq_len", "x"), named=("data.seq_len",), passed_before=True),
    Case("fit-seq-len-above-block", "sppo", _fit("--data.seq_len", "8192"), named=("data.seq_len", "block_size"),
         passed_before=True),
    Case("fit-batch-size-0", "sppo", _fit("--data.batch_size", "0"), named=("data.batch_size",), passed_before=True),
    Case("fit-missing-data", "sppo", _fit("--data.path", "data/missing"), named=("data.path",), passed_before=True),
    Case("fit-val-fraction-above-1", "sppo", _fit("--data.val_fraction", "1.5"), named=("data.val_fraction",),
         passed_before=True),
    Case("fit-val-fraction-all", "sppo", _fit("--data.val_fraction", "0.95"), named=("data.val_fraction",),
         passed_before=True),
    Case("fit-val-path-and-fraction", "sppo", _fit("--data.val_fraction", "0.1", "--data.val_path", "data/demo"),
         named=("data.val_path", "data.val_fraction"), passed_before=True),
    Case("fit-num-workers-negative", "sppo", _fit("--data.num_workers", "-1"), named=("data.num_workers",),
         passed_before=True),
    Case("fit-corpus-too-short-packed", "sppo",
         _fit("--data.packing", "true", "--data.seq_len", "65536", "--model.model_overrides", '{"block_size": 65536}'),
         named=("data.seq_len", "data.path")),
    Case("fit-validation-too-short", "sppo",
         _fit("--data.packing", "true", "--data.seq_len", "16384", "--data.val_fraction", "0.15",
              "--model.model_overrides", '{"block_size": 16384}'),
         named=("data.val_fraction", "data.seq_len")),
    # sppo fit: the model's settings
    Case("fit-unknown-model", "sppo", _fit("--model.model", "tinny"), named=("model.model", "tiny")),
    Case("fit-misspelt-option", "sppo", _fit("--model.learning_rat", "1e-3"), named=("--model.learning_rate",),
         passed_before=True),
    Case("fit-learning-rate-negative", "sppo", _fit("--model.learning_rate", "-1"), named=("model.learning_rate",)),
    Case("fit-weight-decay-negative", "sppo", _fit("--model.weight_decay", "-0.1"), named=("model.weight_decay",)),
    Case("fit-betas-above-1", "sppo", _fit("--model.betas", "[1.5, 0.9]"), named=("model.betas",)),
    Case("fit-warmup-negative", "sppo", _fit("--model.warmup_steps", "-5"), named=("model.warmup_steps",)),
    Case("fit-grad-norm-negative", "sppo", _fit("--model.max_grad_norm", "-1"), named=("model.max_grad_norm",)),
    Case("fit-override-typo", "sppo", _fit("--model.model_overrides", '{"n_layr": 3}'),
         named=("model.model_overrides", "n_layer")),
    Case("fit-override-heads", "sppo", _fit("--model.model_overrides", '{"n_head": 3}'),
         named=("model.model_overrides", "n_head")),
    Case("fit-init-from-placeholder", "sppo", _fit("--model.init_from", "/models/REPLACE-ME"),
         named=("--model.init_from",), passed_before=True),
    Case("fit-init-from-not-hf", "sppo", _fit("--model.init_from", "data"), named=("--model.init_from",),
         passed_before=True),
    # sppo fit: the trainer and the strategy
    Case("fit-gpu-without-gpu", "sppo", _fit("--trainer.accelerator", "gpu"), named=("trainer.accelerator",)),
    Case("fit-root-under-a-file", "sppo", _fit("--trainer.default_root_dir", "afile/run"),
         named=("trainer.default_root_dir",)),
    Case("fit-max-steps-negative", "sppo", _fit("--trainer.max_steps", "-5"), named=("max_steps",),
         passed_before=True),
    Case("fit-layout", "sppo", _fit("--trainer.strategy.init_args.pipeline_parallel", "2"),
         named=("pipeline_parallel",)),
    Case("fit-partition-typo", "sppo", _fit("--trainer.strategy.init_args.partition", "lenght"),
         named=("trainer.strategy.init_args", "partition")),
    Case("fit-subsequences-0", "sppo", _fit("--trainer.strategy.init_args.num_subsequences", "0"),
         named=("trainer.strategy.init_args", "num_subsequences")),
    Case("fit-offload-typo", "sppo", _fit("--trainer.strategy.init_args.offload", "ful"),
         named=("trainer.strategy.init_args", "offload")),
    Case("fit-missing-config", "sppo", ("fit", "--config", "nope.yaml"), named=("nope.yaml",), passed_before=True),
    Case("fit-missing-required", "sppo", ("fit", "--trainer.max_steps", "1", "--config", "partial.yaml"),
         named=("data.batch_size",), passed_before=True),
    Case("validate-without-validation-data", "sppo", ("validate", "--config", "my.yaml"),
         named=("data.val_fraction",), passed_before=True),
    Case("fit-subsequences-pipeline-0", "sppo", _fit("--trainer.strategy.init_args.pipeline_parallel", "0"),
         named=("trainer.strategy.init_args", "pipeline_parallel")),
    Case("fit-override-block-negative", "sppo", _fit("--model.model_overrides", '{"block_size": -1}'),
         named=("model.model_overrides", "block_size")),
    Case("fit-missing-val-path", "sppo", _fit("--data.val_path", "data/nope"), named=("data.val_path",),
         passed_before=True),
    # sppo fit: found by the acceptance probes after issue 32 (tracebacks, wrong settings named, silent no-ops)
    Case("fit-seed-negative", "sppo", _fit("--data.seed", "-1"), named=("data.seed",)),
    Case("fit-data-path-empty", "sppo", _fit("--data.path", ""), named=("data.path", "sppo-prepare")),
    Case("fit-num-workers-fraction", "sppo", _fit("--data.num_workers", "1.5"), named=("data.num_workers", "int")),
    Case("fit-override-norm-eps", "sppo", _fit("--model.model_overrides", '{"norm_eps": -1}'),
         named=("model.model_overrides", "norm_eps")),
    Case("fit-init-from-other-architecture", "sppo", _fit("--model.init_from", "bert"),
         named=("model.init_from", "BertModel")),
    Case("fit-layers-per-stage-one-device", "sppo",  # its own folder: it trained before, leaving checkpoints
         _fit("--trainer.strategy.init_args.layers_per_stage", "[3]", "--trainer.default_root_dir", "runs/layers"),
         named=("layers_per_stage", "n_layer=2")),
    Case("fit-fsdp-sync-typo", "sppo", _fit("--trainer.strategy.init_args.fsdp_sync", "never"),
         named=("trainer.strategy.init_args.fsdp_sync", "regather")),
    Case("fit-save-distributed-typo", "sppo",
         _fit("--trainer.strategy.init_args.save_distributed_checkpoint", "maybe"),
         named=("trainer.strategy.init_args.save_distributed_checkpoint",)),
    Case("fit-planner-profile-bad-file", "sppo", _fit("--trainer.strategy.init_args.planner_profile", "badprof.json"),
         named=("trainer.strategy.init_args", "planner_profile", "unknown keys")),
    Case("fit-devices-negative", "sppo", _fit("--trainer.devices", "-3"), named=("trainer.devices",)),
    Case("fit-num-nodes-0", "sppo", _fit("--trainer.num_nodes", "0"), named=("trainer.num_nodes",)),
    Case("fit-accelerator-typo", "sppo", _fit("--trainer.accelerator", "banana"), named=("trainer.accelerator",)),
    Case("fit-strategy-typo", "sppo", _fit("--trainer.strategy", "spp"), named=("trainer.strategy", "sppo")),
    Case("fit-strategy-other", "sppo", _fit("--trainer.strategy", "ddp"), named=("trainer.strategy", "sppo")),
    Case("fit-val-check-interval-0", "sppo", _fit("--trainer.val_check_interval", "0"),
         named=("trainer.val_check_interval",)),
    Case("fit-check-val-every-0", "sppo", _fit("--trainer.check_val_every_n_epoch", "0"),
         named=("trainer.check_val_every_n_epoch",)),
    Case("fit-ckpt-weights-only", "sppo", _fit("--ckpt_path", "plain.pt"), named=("ckpt_path", "--model.init_from")),
    # sppo fit: checkpoints
    Case("fit-ckpt-missing", "sppo", _fit("--ckpt_path", "runs/none/missing.ckpt"), named=("ckpt_path",)),
    Case("fit-ckpt-corrupt", "sppo", _fit("--ckpt_path", "corrupt.ckpt"), named=("ckpt_path", "corrupt.ckpt")),
    Case("fit-ckpt-other-model", "sppo", _fit("--model.model", "small", "--ckpt_path", TINY_CKPT),
         named=("--ckpt_path", "model.model", "'tiny'", "'small'", "--model.init_from")),
    Case("fit-ckpt-not-a-checkpoint", "sppo", _fit("--ckpt_path", "data"), named=("ckpt_path", "not a checkpoint")),
    Case("validate-ckpt-missing", "sppo", ("validate", "--config", "my.yaml", "--data.val_fraction", "0.15",
         "--ckpt_path", "nope.ckpt"), named=("ckpt_path",)),
    Case("fit-earlier-run-in-the-folder", "sppo", _fit("--trainer.default_root_dir", "runs/tiny"),
         named=("trainer.default_root_dir", "--ckpt_path last")),
    Case("fit-ckpt-last-without-checkpoint", "sppo",
         _fit("--trainer.default_root_dir", "runs/first", "--ckpt_path", "last"), code=0, error_lines=0,
         message="ckpt_path=last: no checkpoint in runs/first/checkpoints"),
    Case("fit-ckpt-same-model-longer-block", "sppo",  # the negative control of fit-ckpt-other-model: it resumes
         _fit("--model.model_overrides", '{"block_size": 8192}', "--ckpt_path", TINY_CKPT, "--trainer.max_steps", "3",
              "--trainer.default_root_dir", "runs/tiny"), code=0, error_lines=0,
         message=f"weights from the checkpoint {TINY_CKPT} (resumed)"),
    Case("fit-ckpt-other-data-order", "sppo",  # the position of an epoch of another permutation: refused
         _fit("--data.seed", "7", "--ckpt_path", TINY_CKPT, "--trainer.max_steps", "3",
              "--trainer.default_root_dir", "runs/tiny-data"), named=("seed 7", "data.seed", "--model.init_from")),
    # sppo-export
    Case("export-missing", "sppo-export", ("missing.ckpt", "hf-a"), named=("checkpoint", "missing.ckpt")),
    Case("export-corrupt", "sppo-export", ("corrupt.ckpt", "hf-b"), named=("checkpoint", "corrupt.ckpt")),
    Case("export-out-is-a-file", "sppo-export", (TINY_CKPT, "afile"), named=("out_dir", "afile")),
    Case("export-override-typo", "sppo-export", (TINY_CKPT, "hf-c", "--override", "n_layr=3"),
         named=("--override", "n_layer")),
    Case("export-shard-size-0", "sppo-export", (TINY_CKPT, "hf-d", "--max-shard-gb", "0"), named=("--max-shard-gb",)),
    Case("export-shard-size-negative", "sppo-export", (TINY_CKPT, "hf-e", "--max-shard-gb", "-1"),
         named=("--max-shard-gb",)),
    Case("export-init-from-moved", "sppo-export", ("moved.ckpt", "hf-f"), named=("--model", "init_from")),
    Case("export-other-shape", "sppo-export", ("plain.pt", "hf-g", "--model", "tiny", "--override", "norm_qk=true"),
         named=("--model", "--override")),
    Case("export-override-invalid", "sppo-export", (TINY_CKPT, "hf-k", "--override", "n_head=3"),
         named=("--override", "n_head")),
    Case("export-not-a-checkpoint", "sppo-export", ("data", "hf-l"), named=("checkpoint", "not a checkpoint")),
    Case("export-into-an-export", "sppo-export", (TINY_CKPT, "hf-used"), named=("out_dir", "--replace")),
    Case("export-unknown-model", "sppo-export", ("plain.pt", "hf-h", "--model", "tinny"), named=("--model",),
         passed_before=True),
    Case("export-override-format", "sppo-export", (TINY_CKPT, "hf-i", "--override", "n_layer"),
         named=("--override",), passed_before=True),
    Case("export-dtype", "sppo-export", (TINY_CKPT, "hf-j", "--dtype", "fp8"), named=("--dtype",), passed_before=True),
    Case("export-shard-size-inf", "sppo-export", (TINY_CKPT, "hf-m", "--max-shard-gb", "inf"),
         named=("--max-shard-gb",)),
    Case("export-tokenizer-missing", "sppo-export", (TINY_CKPT, "hf-n", "--tokenizer", "no-tok"),
         named=("--tokenizer", "no-tok")),
    # sppo-prepare
    Case("prepare-output-under-a-file", "sppo-prepare", ("data/corpus", "--output", "afile/tokens"),
         named=("--output", "afile")),
    Case("prepare-output-exists", "sppo-prepare", ("data/corpus", "--output", "data/demo"),
         named=("--output", "demo.bin' exists", "--replace")),
    Case("prepare-missing-input", "sppo-prepare", ("no-such-dir", "--output", "out/t"), named=("INPUT", "no-such-dir")),
    Case("prepare-missing-tokenizer", "sppo-prepare", ("data/corpus", "--output", "out/t", "--tokenizer", "no-tok"),
         named=("--tokenizer",)),
    Case("prepare-bad-json-line", "sppo-prepare", ("bad.jsonl", "--output", "out/t"), named=("bad.jsonl:2",)),
    Case("prepare-missing-text-field", "sppo-prepare", ("good.jsonl", "--output", "out/t", "--text-field", "body"),
         named=("--text-field",)),
    Case("prepare-verify-missing", "sppo-prepare", ("--verify", "out/none"), named=("out/none",)),
    Case("prepare-workers-0", "sppo-prepare", ("data/corpus", "--output", "out/t", "--workers", "0"),
         named=("--workers",), passed_before=True),
    Case("prepare-output-and-verify", "sppo-prepare", ("--verify", "data/demo", "--output", "out/t"),
         named=("--verify",), passed_before=True),
    Case("prepare-broken-tokenizer", "sppo-prepare", ("good.jsonl", "--output", "out/t", "--tokenizer", "broken-tok"),
         named=("--tokenizer", "broken-tok")),
    Case("prepare-broken-parquet", "sppo-prepare", ("broken.parquet", "--output", "out/t"), named=("broken.parquet",)),
    Case("prepare-output-a-folder", "sppo-prepare", ("good.jsonl", "--output", "out/"), named=("--output",)),
    Case("prepare-eos-id-range", "sppo-prepare", ("good.jsonl", "--output", "out/t", "--eos-id", "300"),
         named=("--eos-id",)),
    # sppo-plan (its own convention already: 2 for usage, 1 when no layout fits, a pinned size included)
    Case("plan-seq-len-0", "sppo-plan", ("--model", "gpt-7b", "--seq-len", "0"), named=("--seq-len",),
         passed_before=True),
    Case("plan-unknown-model", "sppo-plan", ("--model", "gpt-7", "--seq-len", "64K"), named=("--model",),
         passed_before=True),
    Case("plan-gpus-per-node-0", "sppo-plan", ("--model", "gpt-7b", "--seq-len", "64K", "--gpus-per-node", "0"),
         named=("--gpus-per-node",), passed_before=True),
    Case("plan-gpus-per-node-9", "sppo-plan", ("--model", "tiny", "--seq-len", "4K", "--gpus-per-node", "9"),
         named=("--gpus-per-node=9", "up to 8 GPUs")),
    Case("plan-sp-heads", "sppo-plan", ("--model", "tiny", "--seq-len", "4K", "--nodes", "1", "--sp", "3"), code=1,
         named=("--sp",), passed_before=True),
    Case("plan-nothing-fits", "sppo-plan", ("--model", "tiny", "--seq-len", "4K", "--nodes", "1", "--host-memory",
         "1K", "--pp", "1", "--sp", "1", "--num-subsequences", "1", "--offload", "full"), code=1,
         named=("--host-memory",), passed_before=True),
    Case("plan-block-size-text", "sppo-plan", ("--model", "tiny", "--seq-len", "4K", "--block-size", "abc"),
         named=("--block-size",)),
    Case("plan-profile-values", "sppo-plan", ("--model", "tiny", "--seq-len", "4K", "--gpu", "bad-values.json"),
         named=("--gpu", "hbm_bytes")),
    Case("plan-calibrate-device-typo", "sppo-plan", ("--calibrate", "--device", "banana", "--quick"),
         named=("--device",)),
    Case("plan-calibrate-out-folder", "sppo-plan", ("--calibrate", "--device", "cpu", "--quick", "--out", "data"),
         named=("--out",)),
    # Fabric: Python arguments, no flags
    Case("fabric-sequence-above-block-auto", "fabric", call=lambda: _fabric_step(8192, "auto"),
         named=("block_size",), absent=("--",)),
    Case("fabric-sequence-above-block", "fabric", call=lambda: _fabric_step(8192, 2), named=("block_size",),
         absent=("--",), passed_before=True),
    Case("fabric-targets-shape", "fabric", call=_fabric_batch(lambda ids, targets: (ids, targets[:, :-1])),
         named=("targets",), absent=("--",), passed_before=True),
    Case("fabric-id-beyond-vocab", "fabric", call=_fabric_batch(lambda ids, targets: (_set(ids, 10**6), targets)),
         named=("input_ids", "1000000", "vocab_size"), absent=("--",)),
    Case("fabric-negative-target", "fabric", call=_fabric_batch(lambda ids, targets: (ids, _set(targets, -5))),
         named=("targets", "-5", "-100"), absent=("--",)),
    Case("fabric-pipeline-0", "fabric", call=_fabric_strategy(pipeline_parallel=0), named=("pipeline_parallel",),
         absent=("--",), passed_before=True),
    Case("fabric-partition-typo", "fabric", call=_fabric_strategy(partition="lenght"), named=("partition",),
         absent=("--",), passed_before=True),
    Case("fabric-load-other-model", "fabric", call=_fabric_load_other_model, named=("n_query_groups",),
         absent=("--",)),
    Case("fabric-layers-per-stage-one-device", "fabric", call=lambda: _fabric_step(64, 2, layers_per_stage=[3]),
         named=("layers_per_stage", "n_layer=2"), absent=("--",)),
    Case("fabric-layers-per-stage-text", "fabric", call=_fabric_strategy(layers_per_stage="2"),
         named=("layers_per_stage",), absent=("--",)),
    Case("fabric-save-distributed-text", "fabric", call=_fabric_strategy(save_distributed_checkpoint="no"),
         named=("save_distributed_checkpoint",), absent=("--",)),
    Case("fabric-microbatches-one-device", "fabric", call=lambda: _fabric_step(64, 2, num_microbatches=2),
         named=("num_microbatches=2",), absent=("--",)),
]
# fmt: on


# -- the scratch folder --------------------------------------------------------------------------------------


def prepare_folder(work: Path) -> None:
    """Data, the minimal config, and the files the cases name: a checkpoint of ``tiny`` (a real 2-step run), a
    truncated copy, a file where a folder is asked for, an earlier sharded export, a checkpoint whose
    ``init_from`` folder is gone and that records no architecture; broken inputs (a tokenizer.json without a model,
    a file that is not Parquet, a config.json of another architecture, planner profiles with bad keys and values)."""
    import torch

    from lightning_sppo import GPT, GPTConfig

    (work / "data").mkdir(parents=True)
    for suffix in ("bin", "idx", "json"):
        shutil.copy(ROOT / "data" / f"demo.{suffix}", work / "data" / f"demo.{suffix}")
    shutil.copytree(ROOT / "data" / "corpus", work / "data" / "corpus")
    (work / "my.yaml").write_text(MY_YAML)
    (work / "partial.yaml").write_text(MY_YAML.replace("  batch_size: 2\n", ""))
    (work / "afile").write_text("a file, not a folder\n")
    (work / "bad.jsonl").write_text('{"text": "one"}\nnot json\n')
    (work / "good.jsonl").write_text('{"text": "one"}\n')
    (work / "broken.parquet").write_bytes(b"garbage")  # not Parquet
    (work / "broken-tok").mkdir()
    (work / "broken-tok" / "tokenizer.json").write_text("{}")  # a tokenizer.json without a model
    (work / "bert").mkdir()
    (work / "bert" / "config.json").write_text('{"model_type": "bert", "architectures": ["BertModel"]}')
    (work / "badprof.json").write_text('{"not": "a profile"}')
    from lightning_sppo.planner.profile import BUILTIN_PROFILES

    (work / "bad-values.json").write_text(json.dumps(dict(BUILTIN_PROFILES["h100"].to_dict(), hbm_bytes="lots")))
    with _in(work):
        setup = run_program("sppo", (*FIT, "--trainer.default_root_dir", "runs/tiny"))
        assert setup.code == 0 and (work / TINY_CKPT).is_file(), setup.output[-3000:]
        shutil.rmtree(work / "runs/tiny/csv", ignore_errors=True)
        export = run_program("sppo-export", (TINY_CKPT, "hf-used", "--max-shard-gb", "0.0001"))
        assert export.code == 0, export.output[-3000:]
    data = (work / TINY_CKPT).read_bytes()
    (work / "corrupt.ckpt").write_bytes(data[: len(data) // 2])
    saved = torch.load(work / TINY_CKPT, weights_only=False)
    saved.pop("model_config", None)
    saved["hyper_parameters"] = dict(saved["hyper_parameters"], init_from="gone/llama", model="tiny")
    torch.save(saved, work / "moved.ckpt")
    torch.save({"model": GPT(GPTConfig.from_name("tiny")).state_dict()}, work / "plain.pt")
    tiny = GPT(GPTConfig.from_name("tiny"))
    torch.save({"model": tiny.state_dict(), "model_config": tiny.config.to_dict()}, work / "fabric-tiny.pt")


@contextlib.contextmanager
def _in(folder: Path):
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def _captured():
    """stdout and stderr of this process (file descriptors 1 and 2) into one temporary file."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        text = [""]
        try:
            yield text
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            out.seek(0)
            text[0] = out.read()


def run_program(program: str, args: tuple[str, ...]) -> Outcome:
    """The console script's function in this process, as ``sys.exit(main())`` would end."""
    import importlib

    module, _, function = PROGRAMS[program].partition(":")
    entry = getattr(importlib.import_module(module), function)
    sys.argv = [program, *args]
    with _captured() as text, warnings.catch_warnings():
        warnings.resetwarnings()  # a warning an earlier case printed is printed again
        try:
            code = entry()  # reads sys.argv, as the console script does
        except SystemExit as exit_:
            code = exit_.code
        except BaseException:
            traceback.print_exc()
            code = 1
    code = 0 if code is None else code if isinstance(code, int) else 1
    return _outcome(code, text[0], program)


def run_call(call: Callable[[], None]) -> Outcome:
    """A Fabric user's code: the exception it raises (type and message), as Outcome(0 or 1, ...)."""
    with _captured() as text:
        try:
            call()
            error = None
        except Exception as caught:  # what the user's script would see
            error = caught
    if error is None:
        return Outcome(0, text[0])
    from lightning_sppo.errors import is_settings_error

    message = str(error)
    code = 2 if is_settings_error(error) else 1  # SPPOConfigError, or another typed ValueError of the package
    return Outcome(code, text[0], f"{type(error).__name__}: {message}", len(message.splitlines()), [message])


def _outcome(code: int, output: str, program: str) -> Outcome:
    lines = [line for line in output.splitlines() if line.strip()]
    prefix = f"{program}: " if program == "sppo-plan" else f"{program}: error:"  # sppo-plan's "nothing fits" too
    return Outcome(code, output, "", len(lines), [line for line in lines if line.startswith(prefix)])


def run_cases(work: Path, cases: list[Case] = CASES) -> dict[str, Outcome]:
    prepare_folder(work)
    outcomes = {}
    for case in cases:
        with _in(work):
            outcomes[case.id] = run_call(case.call) if case.call else run_program(case.program, case.args)
    return outcomes


def check(case: Case, outcome: Outcome) -> list[str]:
    """What is wrong with ``outcome`` for ``case`` (empty: it ends as it must)."""
    problems = []
    if outcome.code != case.code:
        problems.append(f"exit status {outcome.code}, not {case.code}")
    if len(outcome.errors) != case.error_lines:
        problems.append(f"{len(outcome.errors)} error lines, not {case.error_lines}")
    if "Traceback" in outcome.output or "Traceback" in outcome.error:
        problems.append("a traceback")
    line = " ".join(outcome.errors)
    problems += [f"does not name {text!r}" for text in case.named if text not in line]
    problems += [f"names {text!r}" for text in case.absent if text in line]
    if case.message and case.message not in outcome.output:
        problems.append(f"does not say {case.message!r}")
    if case.program == "fabric" and outcome.lines != 1:
        problems.append(f"a message of {outcome.lines} lines")
    return problems


def table(outcomes: dict[str, Outcome], cases: list[Case] = CASES) -> str:
    rows = ["| case | command | exit | lines | error lines | as it must? |", "| --- | --- | ---: | ---: | ---: | --- |"]
    for case in cases:
        outcome = outcomes[case.id]
        what = "Python call" if case.call else " ".join([case.program, *case.args])
        problems = check(case, outcome)
        verdict = "yes" if not problems else "no: " + "; ".join(problems)
        rows.append(f"| {case.id} | `{what}` | {outcome.code} | {outcome.lines} | {len(outcome.errors)} | {verdict} |")
    return "\n".join(rows)


if __name__ == "__main__":
    save_to = sys.argv[1] if len(sys.argv) > 1 else None  # a JSON file for every outcome in full
    with tempfile.TemporaryDirectory() as folder:
        results = run_cases(Path(folder) / "work")
    print(table(results))
    if save_to:
        Path(save_to).write_text(json.dumps({k: vars(v) for k, v in results.items()}, indent=1))
