"""sppo-export: checkpoints of every format this project writes, loaded back by ``transformers``.

The distributed folder written by a real pipeline + FSDP layout is exported in tests/distributed/test_tied.py
and a Trainer ``.ckpt`` in tests/training/test_init_from.py; here the formats are built directly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.model.export import main, read_checkpoint
from tests.model.hf_reference import batch, load_hf, rel


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


def test_gpt_preset_needs_model_when_nothing_is_recorded(tmp_path):
    model = GPT(GPTConfig.from_name("tiny-gqa"))
    torch.save({"model": model.state_dict()}, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="pass --model NAME"):
        main([str(tmp_path / "old.pt"), str(tmp_path / "hf")])
    main([str(tmp_path / "old.pt"), str(tmp_path / "hf"), "--model", "tiny-gqa", "--override", "block_size=8192"])
    assert load_hf(tmp_path / "hf").config.max_position_embeddings == 8192
    _logits_match(model, tmp_path / "hf")


def test_architectures_without_hf_equivalent_and_wrong_files_are_clear_errors(tmp_path):
    torch.save({"model": GPT(GPTConfig.from_name("tiny-gelu")).state_dict()}, tmp_path / "gelu.pt")
    with pytest.raises(ValueError, match="mlp='gelu'"):
        main([str(tmp_path / "gelu.pt"), str(tmp_path / "hf"), "--model", "tiny-gelu"])
    torch.save({"model": GPT(GPTConfig.from_name("tiny")).state_dict()}, tmp_path / "tiny.pt")
    with pytest.raises(ValueError, match=r"lacks \['blocks.0.attn.norm_k.weight"):  # --model of another shape
        main([str(tmp_path / "tiny.pt"), str(tmp_path / "hf"), "--model", "tiny", "--override", "norm_qk=true"])
    torch.save({"a": {"x": torch.ones(1)}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="exactly one GPT state dict"):
        read_checkpoint(tmp_path / "other.pt")
