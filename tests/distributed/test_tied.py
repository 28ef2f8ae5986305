"""Tied embeddings with a pipeline (gloo): the first and last stages' copies behave as the plain model's one
parameter, starting from Hugging Face weights; the checkpoints export back to Hugging Face."""

from __future__ import annotations

import pytest
import torch

from lightning_sppo.model.export import main as export
from lightning_sppo.model.hf import load_hf_model
from tests.distributed import tied_workers
from tests.distributed.harness import run_distributed
from tests.model.hf_reference import batch, load_hf, rel, save_hf_checkpoint

pytestmark = pytest.mark.slow  # several processes (gloo) per test


@pytest.mark.parametrize(("pp", "dp"), [(2, 1), (2, 2)], ids=["pp2", "pp2-dp2"])
def test_tied_pipeline_matches_plain_model_and_exports(pp, dp, tmp_path):
    hf_path = tmp_path / "hf"
    save_hf_checkpoint("llama3-scaling-tied", hf_path)
    run_distributed(tied_workers.tied_pipeline, pp * dp, pp, str(hf_path), str(tmp_path))

    expected = torch.load(tmp_path / "expected.pt")
    single = torch.load(tmp_path / "single.pt", weights_only=False)
    assert set(single["model"]) == set(load_hf_model(hf_path).state_dict())  # both wte and lm_head, as the plain
    for name, value in single["model"].items():
        assert rel(value, expected[name]) < 1e-5, name
    assert torch.equal(single["model"]["wte.weight"], single["model"]["lm_head.weight"])  # the copies agree

    plain = load_hf_model(hf_path)
    plain.load_state_dict(expected)
    ids, _ = batch(plain.config.vocab_size)
    source = tmp_path / ("distributed" if dp > 1 else "single.pt")  # a DCP folder of FSDP shards, or one file
    out = tmp_path / "exported"
    export([str(source), str(out)])  # the sppo-export command, in process
    assert not (out / "model.safetensors.index.json").exists() and (out / "model.safetensors").is_file()
    with torch.no_grad():
        assert rel(load_hf(out)(ids).logits, plain(ids)) < 1e-5


def test_tied_optimizer_state_moves_between_pipeline_and_no_pipeline(tmp_path):
    hf_path = tmp_path / "hf"
    save_hf_checkpoint("llama3-scaling-tied", hf_path)
    run_distributed(tied_workers.tied_optimizer_state_across_layouts, 2, str(hf_path), str(tmp_path))
