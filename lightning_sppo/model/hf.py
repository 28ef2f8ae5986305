"""Hugging Face checkpoints in and out: Llama 3.x, Qwen2.5 and Qwen3 folders (``config.json`` + safetensors).

The model file stays plain; this module holds what differs between the families and our ``GPT``:

* the config: ``config_from_hf`` reads a ``config.json`` into a ``GPTConfig`` (unsupported settings are an
  error naming the field), ``hf_config`` writes one back;
* the tensor names (one map, the families share their layout): our fused ``attn.qkv`` holds HF's
  ``q_proj``, ``k_proj`` and ``v_proj`` rows one after the other, and both use the half-split RoPE layout
  (``rotate_half``), so no permutation is needed; a tied head reads ``model.embed_tokens.weight``.

``load_hf_model`` builds a whole model from a folder and ``save_hf_model`` writes one back (the model itself
imports nothing from here). ``load_hf_weights`` fills an already built model, which may be one pipeline stage
(blocks cut away, ``wte`` or ``lm_head`` None) sharded by FSDP2: it opens the safetensors files lazily and
reads only the tensors the stage keeps, and each rank cuts its own shard from the full tensor (no
communication). ``transformers`` is not needed; only ``safetensors``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_sppo.model.config import GPTConfig, RopeScaling
from lightning_sppo.model.gpt import GPT

__all__ = [
    "HF_FAMILIES",
    "HFFamily",
    "check_hf_shapes",
    "config_from_hf",
    "copy_full_tensor",
    "copy_tokenizer_files",
    "hf_config",
    "hf_family",
    "hf_model_config",
    "hf_state_dict",
    "load_hf_model",
    "load_hf_weights",
    "read_hf_config",
    "save_hf",
    "save_hf_model",
]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
"""Files of a Hugging Face folder that are not the model's weights or architecture but belong with them: the
tokenizer's (any of its formats), its chat template and the special token ids used to generate."""


@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face architecture we convert, and what its ``config.json`` leaves implicit."""

    architecture: str
    """``architectures[0]`` in config.json."""
    model_type: str
    """``model_type`` in config.json."""
    default_head_dim: int | None
    """``head_dim`` when config.json omits it; None: hidden_size // num_attention_heads."""


HF_FAMILIES: dict[str, HFFamily] = {
    f.model_type: f
    for f in (
        HFFamily("LlamaForCausalLM", "llama", None),
        HFFamily("Qwen2ForCausalLM", "qwen2", None),
        HFFamily("Qwen3ForCausalLM", "qwen3", 128),  # Qwen3Config's default head_dim
    )
}

# -- config.json -> GPTConfig --------------------------------------------------------------------------------

_ROPE_KEYS = {
    "default": set(),
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "truncate"},
}


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face checkpoint folder."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint folder: it has no config.json.")
    try:
        hf = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file} is not a JSON file ({error}).") from error
    if not isinstance(hf, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(hf).__name__}.")
    return hf


def hf_model_config(path: str | Path, **overrides: Any) -> GPTConfig:
    """The ``GPTConfig`` of a Hugging Face folder, with ``GPTConfig`` field overrides (e.g. ``block_size``)."""
    return replace(config_from_hf(read_hf_config(path), name=Path(path).name), **overrides)


def config_from_hf(hf: Mapping[str, Any], name: str = "") -> GPTConfig:
    """A ``GPTConfig`` from a Hugging Face ``config.json`` dict; settings we cannot run are an error."""
    family = _family_of(hf)
    heads = _required(hf, "num_attention_heads")
    hidden = _required(hf, "hidden_size")
    head_dim = hf.get("head_dim") or family.default_head_dim or hidden // heads
    _check_unsupported(hf, family)
    rope_base, rope_scaling = _rope_from_hf(hf)
    bias = bool(hf.get("attention_bias", False)) if family.model_type == "llama" else False
    return GPTConfig(
        name=name,
        block_size=_required(hf, "max_position_embeddings"),
        vocab_size=_required(hf, "vocab_size"),
        n_layer=_required(hf, "num_hidden_layers"),
        n_embd=hidden,
        n_head=heads,
        n_query_groups=hf.get("num_key_value_heads") or heads,
        head_size=head_dim,
        intermediate_size=_required(hf, "intermediate_size"),
        mlp="swiglu",
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        bias=bias,
        attn_bias=family.model_type == "qwen2",
        norm_qk=family.model_type == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_base=rope_base,
        rope_scaling=rope_scaling,
    )


def _family_of(hf: Mapping[str, Any]) -> HFFamily:
    architectures = hf.get("architectures") or []
    by_architecture = {f.architecture: f for f in HF_FAMILIES.values()}
    supported = sorted(by_architecture)
    if architectures:
        if len(architectures) != 1 or architectures[0] not in by_architecture:
            raise ValueError(f"Unsupported architectures={architectures} in config.json; supported: {supported}.")
        return by_architecture[architectures[0]]
    model_type = hf.get("model_type")
    if model_type not in HF_FAMILIES:
        raise ValueError(
            f"Unsupported model_type={model_type!r} in config.json (and no architectures); supported:"
            f" {sorted(HF_FAMILIES)}."
        )
    return HF_FAMILIES[model_type]


def _required(hf: Mapping[str, Any], key: str) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json needs a positive integer {key}, got {key}={value!r}.")
    return value


def _check_unsupported(hf: Mapping[str, Any], family: HFFamily) -> None:
    """Settings of these families that our GPT does not implement: one error naming the field."""
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only 'silu' SwiGLU)")
    if hf.get("attention_dropout", 0.0):
        problems.append(f"attention_dropout={hf['attention_dropout']!r} (no dropout; set it to 0.0)")
    if family.model_type == "llama" and bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
        problems.append(
            f"attention_bias={hf.get('attention_bias')} with mlp_bias={hf.get('mlp_bias')} (biases on every"
            " linear layer or on none)"
        )
    if family.model_type == "qwen3" and hf.get("attention_bias", False):
        problems.append("attention_bias=True (Qwen3 with biases on q/k/v/o is not supported)")
    if hf.get("use_sliding_window", False) and _sliding_layers(hf):
        problems.append(
            f"use_sliding_window=True with sliding_window={hf.get('sliding_window')} on layers"
            f" {_sliding_layers(hf)} (only full causal attention)"
        )
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={hf['partial_rotary_factor']} (RoPE over the whole head only)")
    if problems:
        raise ValueError(f"Unsupported {family.architecture} settings in config.json: {'; '.join(problems)}.")


def _sliding_layers(hf: Mapping[str, Any]) -> list[int]:
    """Layers that would use a sliding window when ``use_sliding_window`` is on (transformers' rule)."""
    if hf.get("sliding_window") is None:
        return []
    layer_types = hf.get("layer_types")
    if layer_types:
        return [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    first = hf.get("max_window_layers", 28)
    return list(range(first, hf.get("num_hidden_layers", 0)))


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 4's ``rope_theta`` + ``rope_scaling`` or 5's ``rope_parameters``."""
    parameters = hf.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in parameters.values()):
        raise ValueError(
            f"Unsupported per-layer rope_parameters={parameters} in config.json (one RoPE for all layers)."
        )
    scaling = dict(hf.get("rope_scaling") or parameters)  # transformers 5 also prefers rope_scaling when both are set
    theta = scaling.pop("rope_theta", None) or parameters.get("rope_theta") or hf.get("rope_theta") or 10000.0
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if scaling.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("Unsupported rope_scaling.partial_rotary_factor != 1.0 in config.json (whole-head RoPE only).")
    if kind not in _ROPE_KEYS:
        raise ValueError(
            f"Unsupported rope_scaling.rope_type={kind!r} in config.json; supported: {sorted(_ROPE_KEYS)}."
        )
    unknown = sorted(set(scaling) - _ROPE_KEYS[kind])
    if unknown:
        raise ValueError(
            f"Unsupported rope_scaling fields {unknown} for rope_type={kind!r} in config.json; supported:"
            f" {sorted(_ROPE_KEYS[kind])}."
        )
    if kind == "default":
        return float(theta), None
    # transformers fills these in the same way when config.json leaves them out.
    scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if scaling.get("factor") is None and kind == "yarn":
        scaling["factor"] = hf["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    for key in ("beta_fast", "beta_slow"):
        if scaling.get(key) is None:
            scaling.pop(key, None)
    return float(theta), RopeScaling(type=kind, **scaling)


# -- GPTConfig -> config.json --------------------------------------------------------------------------------


def hf_family(config: GPTConfig) -> HFFamily:
    """The Hugging Face architecture that computes what ``GPT(config)`` does, or an error naming the field.

    Qwen3 for q/k norms, Qwen2 for a q/k/v-only bias, else Llama (which also covers our ``gpt-*`` presets).
    """
    problems = []
    if config.mlp != "swiglu":
        problems.append(f"mlp={config.mlp!r} (need 'swiglu')")
    if config.norm != "rmsnorm":
        problems.append(f"norm={config.norm!r} (need 'rmsnorm')")
    if config.rotary_percentage != 1.0:
        problems.append(f"rotary_percentage={config.rotary_percentage} (need 1.0)")
    if config.norm_qk and (config.bias or config.attn_bias):
        problems.append("norm_qk=True with bias or attn_bias (Qwen3 has neither)")
    if problems:
        raise ValueError(
            f"GPTConfig(name={config.name!r}) has no Hugging Face equivalent among"
            f" {[f.architecture for f in HF_FAMILIES.values()]}: {'; '.join(problems)}."
        )
    if config.norm_qk:
        return HF_FAMILIES["qwen3"]
    if config.attn_bias and not config.bias:
        return HF_FAMILIES["qwen2"]
    return HF_FAMILIES["llama"]


def hf_config(config: GPTConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` of ``GPT(config)``: readable by transformers 4 (``rope_theta`` + ``rope_scaling``)
    and 5 (``rope_parameters``)."""
    family = hf_family(config)
    scaling = _rope_to_hf(config.rope_scaling)
    out: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_query_groups,
        "head_dim": config.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
        "rope_theta": config.rope_base,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base} | (scaling or {}),
        "dtype": str(dtype).removeprefix("torch."),  # transformers >= 4.56; older ones read torch_dtype
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if family.model_type == "llama":
        out |= {"attention_bias": config.bias, "mlp_bias": config.bias}
    else:
        out |= {"use_sliding_window": False, "sliding_window": None}
    if family.model_type == "qwen3":
        out["attention_bias"] = False
    return out


def _rope_to_hf(scaling: RopeScaling | None) -> dict[str, Any] | None:
    if scaling is None:
        return None
    out: dict[str, Any] = {"rope_type": scaling.type, "factor": scaling.factor}
    out["original_max_position_embeddings"] = scaling.original_max_position_embeddings
    if scaling.type == "llama3":
        return out | {"low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor}
    out |= {"beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow, "truncate": scaling.truncate}
    return out if scaling.attention_factor is None else out | {"attention_factor": scaling.attention_factor}


# -- tensor names --------------------------------------------------------------------------------------------

_TOP = {
    "wte.weight": "model.embed_tokens.weight",
    "norm_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# Inside blocks.{i}. (ours) and model.layers.{i}. (HF); the fused qkv is three HF tensors, in this order.
_BLOCK = {
    "norm_1.weight": ("input_layernorm.weight",),
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "attn.proj.weight": ("self_attn.o_proj.weight",),
    "attn.proj.bias": ("self_attn.o_proj.bias",),
    "attn.norm_q.weight": ("self_attn.q_norm.weight",),
    "attn.norm_k.weight": ("self_attn.k_norm.weight",),
    "norm_2.weight": ("post_attention_layernorm.weight",),
    "mlp.fc_1.weight": ("mlp.gate_proj.weight",),
    "mlp.fc_1.bias": ("mlp.gate_proj.bias",),
    "mlp.fc_2.weight": ("mlp.up_proj.weight",),
    "mlp.fc_2.bias": ("mlp.up_proj.bias",),
    "mlp.proj.weight": ("mlp.down_proj.weight",),
    "mlp.proj.bias": ("mlp.down_proj.bias",),
}
_BLOCK_NAME = re.compile(r"blocks\.(\d+)\.(.+)")
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")  # a buffer some older checkpoints saved


def hf_names(name: str, config: GPTConfig) -> tuple[str, ...]:
    """The Hugging Face tensors behind one of our state-dict entries (three for the fused qkv)."""
    if name == "lm_head.weight" and config.tie_embeddings:
        return (_TOP["wte.weight"],)  # tied checkpoints carry the embedding only
    if name in _TOP:
        return (_TOP[name],)
    match = _BLOCK_NAME.fullmatch(name)
    if match is None or match.group(2) not in _BLOCK:
        raise KeyError(f"No Hugging Face name for the GPT tensor {name!r}.")
    return tuple(f"model.layers.{match.group(1)}.{hf}" for hf in _BLOCK[match.group(2)])


def _expected_names(config: GPTConfig) -> set[str]:
    """Every tensor a checkpoint of ``GPT(config)`` holds, in Hugging Face names."""
    with torch.device("meta"):
        model = GPT(config)
    return {hf for name in model.state_dict() for hf in hf_names(name, config)}


def _qkv_sizes(config: GPTConfig) -> tuple[int, int, int]:
    q, kv = config.n_head * config.head_size, config.n_query_groups * config.head_size
    return q, kv, kv


def hf_state_dict(config: GPTConfig, state_dict: Mapping[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    """Our (whole-model) state dict as Hugging Face (name, tensor) pairs; a tied head is left out as
    ``transformers`` does. Split q/k/v are copies, so no two tensors share memory (safetensors refuses that)."""
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue
        names = hf_names(name, config)
        if len(names) == 1:
            yield names[0], tensor
        else:
            yield from zip(names, (part.clone() for part in tensor.split(_qkv_sizes(config))), strict=True)


# -- reading -------------------------------------------------------------------------------------------------


def load_hf_model(path: str | Path, dtype: torch.dtype | None = None) -> GPT:
    """The whole ``GPT`` of a local Hugging Face checkpoint folder (``config.json`` + ``*.safetensors``): Llama
    3.x, Qwen2.5 or Qwen3. The config comes from config.json; parameters are allocated once (no random init) and
    filled. ``dtype`` None keeps torch's default dtype (float32 master weights)."""
    path = Path(path)
    config = hf_model_config(path)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    if dtype is not None:
        model.to(dtype)
    load_hf_weights(model, path)
    return model


def load_hf_weights(model: GPT, path: str | Path) -> list[str]:
    """Fill ``model`` in place from the safetensors of a Hugging Face folder; returns the names read.

    ``model`` may be a pipeline stage (only its tensors are read) and FSDP2-sharded (each parameter gets its
    shard of the full tensor, cut locally). The checkpoint must hold exactly the tensors of
    ``GPT(model.config)`` (a tied head's ``lm_head.weight`` may be there or not); anything missing, extra or of
    another shape is an error naming the tensor.
    """
    path = Path(path)
    files = _weight_files(path)
    _check_names(model.config, set(files), path)
    targets: dict[int, tuple[str, Tensor]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        targets.setdefault(id(param), (name, param))  # a tied weight once
    read: list[str] = []
    with ExitStack() as stack, torch.no_grad():
        handles: dict[Path, Any] = {}
        for name, param in targets.values():
            names = hf_names(name, model.config)
            parts = [_get_tensor(stack, handles, files[hf], hf) for hf in names]
            full = parts[0] if len(parts) == 1 else torch.cat(parts)
            if tuple(full.shape) != tuple(param.shape):
                raise ValueError(
                    f"{path}: {' + '.join(names)} has shape {tuple(full.shape)}, but {name} needs"
                    f" {tuple(param.shape)}; the checkpoint is not this model (check config.json)."
                )
            copy_full_tensor(param, full)
            read += names
    return sorted(read)


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index of a sharded checkpoint or the file(s) themselves."""
    if (path / _INDEX).is_file():
        return {name: path / file for name, file in _weight_map(path / _INDEX).items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no {_INDEX} and no *.safetensors files.")
    out: dict[str, Path] = {}
    for file in files:
        with ExitStack() as stack:
            out |= dict.fromkeys(_safetensors(stack, file).keys(), file)
    return out


def check_hf_shapes(path: str | Path, config: GPTConfig) -> None:
    """``config`` (the folder's config.json) must be the architecture of the folder's tensors, whose shapes are
    read from the safetensors headers (no data): else one ``ValueError`` line. A config.json declaring a larger
    model than its weights would have every rank allocate that model before ``load_hf_weights`` compared one. A
    folder of config.json alone is not checked (a resume takes only the architecture from it; a load of its
    weights says they are missing)."""
    path = Path(path)
    if not (path / _INDEX).is_file() and not any(path.glob("*.safetensors")):
        return
    files = _weight_files(path)
    _check_names(config, set(files), path)
    with torch.device("meta"):
        model = GPT(config)
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for name, param in model.state_dict().items():
            shapes = []
            for hf in hf_names(name, config):
                if files[hf] not in handles:
                    handles[files[hf]] = _safetensors(stack, files[hf])
                shapes.append(tuple(handles[files[hf]].get_slice(hf).get_shape()))
            full = shapes[0] if len(shapes) == 1 else (sum(s[0] for s in shapes), *shapes[0][1:])
            if tuple(full) != tuple(param.shape):
                raise ValueError(
                    f"{path}: {' + '.join(hf_names(name, config))} has shape {full}, but its config.json makes"
                    f" {name} {tuple(param.shape)}; config.json is not that of these weights."
                )


def _weight_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map``: tensor name -> a safetensors file of the index's folder (a name with a path,
    ``../`` or absolute, would read a file elsewhere: refused)."""
    try:
        loaded = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{index} is not a JSON file ({error}).") from None
    weight_map = loaded.get("weight_map") if isinstance(loaded, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map object (tensor name -> safetensors file of the folder).")
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise ValueError(f"{index} maps {name!r} to {file!r}, which is not a file of its folder.")
    return weight_map


def _safetensors(stack: ExitStack, file: Path) -> Any:
    """``file`` opened lazily with safetensors (tensors read one at a time); a missing, damaged or cut-short file is
    one ``ValueError`` line naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return stack.enter_context(safe_open(file, framework="pt"))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{file} cannot be read as a safetensors file ({' '.join(str(error).split())}).") from None


def _check_names(config: GPTConfig, present: set[str], path: Path) -> None:
    expected = _expected_names(config)
    optional = {_TOP["lm_head.weight"]} if config.tie_embeddings else set()
    missing = sorted(expected - present)
    extra = sorted(n for n in present - expected - optional if not _IGNORED.fullmatch(n))
    if missing or extra:
        problems = ([f"missing tensors {missing[:8]}"] if missing else []) + (
            [f"unexpected tensors {extra[:8]}"] if extra else []
        )
        raise ValueError(
            f"{path} does not hold the tensors of this model ({config.n_layer} layers, attn_bias={config.attn_bias},"
            f" norm_qk={config.norm_qk}, tie_embeddings={config.tie_embeddings}): {'; '.join(problems)}"
            f"{' (and more)' if len(missing) > 8 or len(extra) > 8 else ''}."
        )


def _get_tensor(stack: ExitStack, handles: dict[Path, Any], file: Path, name: str) -> Tensor:
    if file not in handles:
        handles[file] = _safetensors(stack, file)
    from safetensors import SafetensorError

    try:
        return handles[file].get_tensor(name)
    except SafetensorError as error:
        raise ValueError(f"{file}: {name} cannot be read ({' '.join(str(error).split())}).") from None


def copy_full_tensor(param: Tensor, full: Tensor) -> None:
    """Copy the full tensor into ``param``; an FSDP2 (DTensor) parameter takes its own shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        # Every rank read the same tensor, so each cuts its shard locally (src_data_rank=None: no scatter).
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)


# -- writing -------------------------------------------------------------------------------------------------


def save_hf_model(model: GPT, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write a whole (unsharded) ``model`` as a Hugging Face checkpoint folder that ``transformers`` loads;
    ``dtype`` None keeps the parameters' dtype."""
    save_hf(model.config, model.state_dict(), Path(path), dtype)


def save_hf(
    config: GPTConfig,
    state_dict: Mapping[str, Tensor],
    path: Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write a Hugging Face folder: config.json and safetensors (``model.safetensors``, or shards of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json``). ``state_dict`` is the whole model's; ``dtype``
    None keeps the tensors' dtype."""
    from safetensors.torch import save_file

    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(
            f"save_hf's max_shard_bytes must be a positive integer, got max_shard_bytes={max_shard_bytes!r}."
        )
    with torch.device("meta"):
        expected = set(GPT(config).state_dict())
    if missing := sorted(expected - set(state_dict)):
        raise ValueError(f"save_hf needs the whole model; the state dict lacks {missing[:8]}.")
    if extra := sorted(set(state_dict) - expected):
        raise ValueError(f"The state dict has tensors that GPT(config) does not: {extra[:8]}.")
    dtype = dtype or next(iter(state_dict.values())).dtype
    config_json = hf_config(config, dtype)  # first: a model without Hugging Face equivalent writes nothing
    shards = _plan_shards(config, state_dict, dtype.itemsize, max_shard_bytes)
    path.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for index, names in enumerate(shards):
        file = _SINGLE if len(shards) == 1 else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        part = {n: state_dict[n] for n in names}
        tensors = {hf: t.detach().to("cpu", dtype).contiguous() for hf, t in hf_state_dict(config, part)}
        save_file(tensors, path / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
    if len(shards) > 1:
        total = sum(state_dict[n].numel() for shard in shards for n in shard) * dtype.itemsize
        index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / _INDEX).write_text(json.dumps(index_json, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")


def copy_tokenizer_files(source: Path, destination: Path) -> list[str]:
    """Copy the ``TOKENIZER_FILES`` that ``source`` holds into ``destination``; returns their names."""
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copy2(source / name, destination / name)
    return copied


def _plan_shards(
    config: GPTConfig, state_dict: Mapping[str, Tensor], itemsize: int, max_shard_bytes: int
) -> list[list[str]]:
    """Our tensor names grouped into files of at most ``max_shard_bytes`` (a larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue
        nbytes = tensor.numel() * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards
