"""A newcomer's path on CPU: a Hugging Face Llama folder in, `sppo fit --config configs/llama-3.2-1b-128k.yaml`
scaled down by command-line overrides, `sppo-export`, and the export reloaded in ``transformers``.

The checkpoint is a tiny random Llama written by ``transformers.save_pretrained`` with Llama 3.2's switches
(tied head, llama3 RoPE scaling, GQA). The shipped config runs unchanged but for ``CPU_OVERRIDES`` (no GPU,
tiny data, 3 steps): packed documents with document masking, validation, W&B (offline), CSV and checkpoints.
``sppo fit`` is forked from the preloaded server (``tests/preloaded.py``).
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import torch

from lightning_sppo.data import write_tokens
from lightning_sppo.model import GPT
from lightning_sppo.model.export import main as export
from lightning_sppo.model.export import read_checkpoint
from lightning_sppo.model.hf import hf_model_config
from tests import preloaded
from tests.model.hf_reference import batch, load_hf, rel, save_hf_checkpoint
from tests.subprocesses import one_thread_env

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "llama-3.2-1b-128k.yaml"
STEPS = 3

CPU_OVERRIDES = [
    "--trainer.accelerator", "cpu",
    "--trainer.devices", "1",
    "--trainer.precision", "32-true",
    "--trainer.max_steps", str(STEPS),
    "--trainer.val_check_interval", "2",
    "--trainer.limit_val_batches", "1",
    "--trainer.default_root_dir", "runs/tiny",
    "--trainer.strategy.init_args.num_subsequences", "2",
    "--trainer.strategy.init_args.granularity", "16",
    "--model.learning_rate", "0.01",  # large enough that 3 steps move the weights visibly
    "--model.min_learning_rate", "0.001",
    "--model.warmup_steps", "0",
    "--data.seq_len", "64",
    "--data.batch_size", "2",
    "--data.val_fraction", "0.2",
]  # fmt: skip
"""What scales the shipped config down to this machine (the docs show the same list)."""


def _env() -> dict[str, str]:
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return one_thread_env(PYTHONPATH=pythonpath, WANDB_MODE="offline", WANDB_SILENT="true")


def test_continue_a_hf_llama_with_a_shipped_config_then_export_reloads_in_transformers(tmp_path):
    save_hf_checkpoint("llama3-scaling-tied", tmp_path / "hf")  # transformers' save_pretrained
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 120, (12,), generator=gen).tolist()  # documents shorter and longer than a window
    write_tokens(tmp_path / "toy", [torch.randint(0, 96, (n,), generator=gen).tolist() for n in lengths], vocab_size=96)

    command = [sys.executable, "-m", "lightning_sppo.training.cli", "fit", "--config", str(CONFIG), *CPU_OVERRIDES,
               "--model.init_from", str(tmp_path / "hf"), "--data.path", str(tmp_path / "toy")]  # fmt: skip
    run = preloaded.run(command, cwd=tmp_path, env=_env(), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]

    rows = list(csv.DictReader(next((tmp_path / "runs/tiny/csv").glob("version_*/metrics.csv")).open()))
    assert sorted(int(r["step"]) for r in rows if r.get("train/loss")) == list(range(STEPS))
    assert any(r.get("val/loss") for r in rows)  # validation ran on the held-out documents
    assert list((tmp_path / "runs/tiny/wandb").glob("offline-run-*"))  # the config's W&B logger, offline

    last = tmp_path / "runs/tiny/checkpoints/last.ckpt"
    export([str(last), str(tmp_path / "exported")])  # sppo-export: config from init_from's config.json
    exported = load_hf(tmp_path / "exported")
    assert exported.config.tie_word_embeddings and exported.config.rope_scaling["rope_type"] == "llama3"

    # The trained model as the checkpoint holds it, run by our GPT (independent of the export's conversion).
    state_dict, meta = read_checkpoint(last)
    assert meta["global_step"] == STEPS
    trained = GPT(hf_model_config(tmp_path / "hf"))
    trained.load_state_dict(state_dict)
    ids, _ = batch(96, seq_len=96)  # past the rope scaling's original context (32): the scaling matters
    untrained = load_hf(tmp_path / "hf")
    with torch.no_grad():
        ours, theirs, before = trained(ids), exported(ids).logits, untrained(ids).logits
    assert rel(theirs, ours) < 1e-5
    assert rel(before, theirs) > 1e-3  # negative control: training changed the model the export holds
