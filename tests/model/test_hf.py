"""load_hf_model / save_hf_model against ``transformers`` (fp32, CPU): logits, loss and every gradient within 1e-5."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lightning_sppo import GPT, GPTConfig
from lightning_sppo.model.hf import (
    config_from_hf,
    hf_config,
    hf_names,
    load_hf_model,
    load_hf_weights,
    read_hf_config,
    save_hf_model,
)
from lightning_sppo.runtime import SubsequenceEngine
from tests.model.hf_reference import (
    CASES,
    IGNORE,
    batch,
    hf_loss_and_grads,
    load_hf,
    rel,
    save_hf_checkpoint,
    worst_grad_error,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each case saved once: ``llama`` as small shards with an index, the others as one model.safetensors."""
    cache = {}

    def get(case: str):
        if case not in cache:
            path = tmp_path_factory.mktemp(case)
            model = save_hf_checkpoint(case, path, max_shard_size="20KB" if case == "llama" else "5GB")
            cache[case] = (path, model)
        return cache[case]

    return get


def _ours(model: GPT, ids: torch.Tensor, targets: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_from_hf_matches_transformers(case, checkpoints):
    path, hf = checkpoints(case)
    ids, targets = batch(hf.config.vocab_size)
    ref_logits, ref_loss, ref_grads = hf_loss_and_grads(hf, ids, targets)
    model = load_hf_model(path)
    logits, loss, grads = _ours(model, ids, targets)
    assert rel(logits, ref_logits) < 1e-5
    assert rel(loss, ref_loss) < 1e-5
    err, where = worst_grad_error(model, grads, ref_grads)
    assert err < 1e-5, f"{case}: grad of {where} off by {err}"
    assert {hf for name in grads for hf in hf_names(name, model.config)} == set(ref_grads)  # every HF tensor


def test_the_cases_exercise_what_they_name(checkpoints):
    """Guards the grid: sharded index, bias, q/k norm, tying and both scalings really reach the model."""
    configs = {case: load_hf_model(checkpoints(case)[0]).config for case in CASES}
    assert (checkpoints("llama")[0] / "model.safetensors.index.json").is_file()
    assert configs["qwen2.5-bias"].attn_bias and not configs["qwen2.5-bias"].bias
    assert configs["qwen3-qk-norm"].norm_qk and configs["llama3-scaling-tied"].tie_embeddings
    assert configs["llama3-scaling"].rope_scaling.type == "llama3" and configs["qwen3-yarn"].rope_scaling.type == "yarn"


@pytest.mark.parametrize(
    ("case", "change"),
    [
        ("llama3-scaling", lambda c: c.__setattr__("rope_scaling", None)),  # scaling matters at this length
        ("qwen3-yarn", lambda c: c.__setattr__("rope_scaling", None)),
        ("llama", lambda c: c.__setattr__("rope_base", 2 * c.rope_base)),
    ],
    ids=["llama3-dropped", "yarn-dropped", "wrong-theta"],
)
def test_negative_control_a_wrong_rope_gives_other_logits(case, change, checkpoints):
    path, hf = checkpoints(case)
    ids, _ = batch(hf.config.vocab_size)
    model = load_hf_model(path)
    change(model.config)  # RoPE is formed from the config at every forward
    with torch.no_grad():
        assert rel(model(ids), hf(ids).logits) > 1e-3


def test_negative_control_dropping_the_qk_norm_gives_other_logits(checkpoints):
    path, hf = checkpoints("qwen3-qk-norm")
    ids, _ = batch(hf.config.vocab_size)
    model = load_hf_model(path)
    for block in model.blocks.values():
        block.attn.norm_q = block.attn.norm_k = torch.nn.Identity()
    with torch.no_grad():
        assert rel(model(ids), hf(ids).logits) > 1e-3


@pytest.mark.parametrize("case", ["llama3-scaling-tied", "qwen2.5-bias", "qwen3-yarn"])
def test_save_hf_round_trips_through_transformers(case, checkpoints, tmp_path):
    path, hf = checkpoints(case)
    ids, _ = batch(hf.config.vocab_size)
    save_hf_model(load_hf_model(path), tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert names == set(load_file(path / "model.safetensors"))  # same tensors (a tied head left out)
    with torch.no_grad():
        assert rel(load_hf(tmp_path)(ids).logits, hf(ids).logits) < 1e-5
    assert replace(load_hf_model(tmp_path).config, name="") == replace(load_hf_model(path).config, name="")


def test_save_hf_shards_with_an_index(checkpoints, tmp_path):
    from lightning_sppo.model.hf import save_hf

    path, hf = checkpoints("qwen3-qk-norm")
    model = load_hf_model(path)
    save_hf(model.config, model.state_dict(), tmp_path, dtype=torch.bfloat16, max_shard_bytes=16_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    reloaded = load_hf(tmp_path)
    assert next(reloaded.parameters()).dtype == torch.float32  # loaded as asked; stored in bf16
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ids, _ = batch(hf.config.vocab_size)
    with torch.no_grad():
        assert 1e-6 < rel(reloaded(ids).logits, hf(ids).logits) < 2e-2  # bf16 rounding, nothing worse


def test_from_hf_trained_with_subsequences_matches_transformers(checkpoints):
    """The subsequence engine (N=4, uneven FLOPs cut) on a load_hf_model model: HF's loss and gradients."""
    path, hf = checkpoints("llama3-scaling-tied")
    ids, targets = batch(hf.config.vocab_size)
    _, ref_loss, ref_grads = hf_loss_and_grads(hf, ids, targets)
    model = load_hf_model(path)
    engine = SubsequenceEngine(4, "flops", attention="reference")
    loss = engine.forward_backward(model, ids, targets)
    assert len(set(engine.plan(ids, model.config).lengths)) > 1
    assert rel(loss, ref_loss) < 1e-5
    err, where = worst_grad_error(model, {n: p.grad for n, p in model.named_parameters()}, ref_grads)
    assert err < 1e-5, f"grad of {where} off by {err}"


def test_from_hf_casts_to_the_requested_dtype(checkpoints):
    model = load_hf_model(checkpoints("llama-tied")[0], dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.wte.weight


# -- errors ---------------------------------------------------------------------------------------------------


def _copy(path, tmp_path):
    for file in path.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    return tmp_path


def test_a_missing_tensor_is_named(checkpoints, tmp_path):
    folder = _copy(checkpoints("qwen3-qk-norm")[0], tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.self_attn.k_norm.weight'\]"):
        load_hf_model(folder)


def test_an_extra_tensor_is_named(checkpoints, tmp_path):
    folder = _copy(checkpoints("llama")[0], tmp_path)
    shard = sorted(folder.glob("*.safetensors"))[0]
    tensors = load_file(shard) | {"model.layers.2.mlp.up_proj.weight": torch.zeros(1)}
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.2.mlp.up_proj.weight"] = shard.name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.2.mlp.up_proj.weight'\]"):
        load_hf_model(folder)


def test_a_tensor_of_the_wrong_shape_is_named(checkpoints, tmp_path):
    folder = _copy(checkpoints("qwen2.5-bias")[0], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": 81}))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight has shape \(80, 64\)"):
        load_hf_model(folder)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(architectures=["MistralForCausalLM"], model_type="mistral"), "architectures=\\['MistralForCausalLM'\\]"),
        (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), "rope_scaling.rope_type='dynamic'"),
        (dict(rope_scaling=dict(rope_type="yarn", factor=2.0, mscale=1.0)), r"rope_scaling fields \['mscale'\]"),
        (
            dict(use_sliding_window=True, sliding_window=16, layer_types=["full_attention", "sliding_attention"]),
            "use_sliding_window=True with sliding_window=16 on layers \\[1\\]",
        ),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(num_hidden_layers=None), "num_hidden_layers=None"),
    ],
)
def test_unsupported_config_fields_are_named(change, match, checkpoints):
    hf = read_hf_config(checkpoints("qwen2.5-bias")[0])
    with pytest.raises(ValueError, match=match):
        config_from_hf(hf | change)


def test_sliding_window_settings_that_are_off_load():
    """Qwen2.5 configs carry a sliding_window that use_sliding_window=false turns off."""
    hf = hf_config(GPTConfig.from_name("qwen2.5-7b")) | dict(sliding_window=131072, max_window_layers=28)
    assert config_from_hf(hf, name="qwen2.5-7b") == GPTConfig.from_name("qwen2.5-7b")


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-7b", "qwen3-8b", "gpt-7b"])
def test_presets_round_trip_through_config_json(name):
    """Our presets written as config.json and read back (``gpt-*`` exports as Llama)."""
    config = GPTConfig.from_name(name)
    hf = hf_config(config)
    assert hf["architectures"] == [
        {"qwen2.5-7b": "Qwen2ForCausalLM", "qwen3-8b": "Qwen3ForCausalLM"}.get(name, "LlamaForCausalLM")
    ]
    assert config_from_hf(json.loads(json.dumps(hf)), name=name) == config


def test_a_model_without_hf_equivalent_names_the_field():
    with pytest.raises(ValueError, match="mlp='gelu'.*norm='layernorm'.*rotary_percentage=0.5"):
        hf_config(GPTConfig.from_name("tiny-gelu"))


def test_load_hf_weights_into_a_cut_stage_reads_only_its_tensors(checkpoints):
    from lightning_sppo.parallel.stages import split_stage

    path, _ = checkpoints("llama3-scaling-tied")
    full = load_hf_model(path)
    stage = split_stage(GPT(full.config), 1, [1, 1])  # the last of two stages: block 1, norm, tied head
    read = load_hf_weights(stage, path)
    assert read == sorted(
        ["model.embed_tokens.weight", "model.norm.weight"]
        + [n for n in read if n.startswith("model.layers.1.")]  # (checked below to be the whole layer)
    )
    assert len([n for n in read if n.startswith("model.layers.1.")]) == 9  # 2 norms, q, k, v, o, 3 MLP
    for name, param in stage.named_parameters():
        assert torch.equal(param, full.get_parameter(name if name != "lm_head.weight" else "wte.weight")), name


# The architecture fields of the upstream config.json files (transformers 4 format), as the presets cite them.
_UPSTREAM = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256,
    },
    "llama-3.1-8b": {  # configs/llama-3.1-8b-*.yaml; no head_dim in this file: hidden_size // heads
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 3584,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
        "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_mrope": False, "use_sliding_window": False, "vocab_size": 152064,
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
        "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
        "vocab_size": 151936,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_UPSTREAM))
def test_upstream_config_json_reads_as_the_preset(name):
    assert config_from_hf(_UPSTREAM[name], name=name) == GPTConfig.from_name(name)
