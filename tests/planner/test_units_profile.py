"""Token counts as people write them, and hardware profiles: built-ins, JSON round trip, errors."""

from __future__ import annotations

import json
import math

import pytest

from lightning_sppo.planner import BUILTIN_PROFILES, HardwareProfile, load_profile, parse_tokens, resolve_profile


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("1048576", 1048576), ("1M", 2**20), ("512K", 2**19), ("512k", 2**19), ("1.28M", 1342177), ("1280K", 1310720),
     ("0.5M", 2**19), (" 4K ", 4096), ("1_024", 1024)],
)  # fmt: skip
def test_parse_tokens(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["", "M", "1.2.3M", "-1M", "1MB", "1e6", "0", "0.0001K"])
def test_parse_tokens_rejects(text):
    with pytest.raises(ValueError, match=r"--seq-len="):
        parse_tokens(text)


def test_builtin_datasheet_figures():
    a100, h100, h200 = (BUILTIN_PROFILES[k] for k in ("a100-80gb", "h100", "h200"))
    assert (a100.peak_bf16_tflops, h100.peak_bf16_tflops, h200.peak_bf16_tflops) == (312.0, 989.0, 989.0)
    assert a100.hbm_bytes == 80 * 2**30 and h200.hbm_bytes == 141 * 10**9
    assert h100.hbm_bytes == 85017493504  # measured on the H100 80GB HBM3 (torch.cuda total_memory)
    assert a100.d2h_gbps < h100.d2h_gbps  # PCIe Gen4 vs Gen5
    assert all(p.gpus_per_node == 8 for p in BUILTIN_PROFILES.values())


def test_json_round_trip(tmp_path):
    path = tmp_path / "gpu.json"
    BUILTIN_PROFILES["h200"].save(path)
    assert load_profile(path) == BUILTIN_PROFILES["h200"]
    assert resolve_profile(str(path), gpus_per_node=4).gpus_per_node == 4


def test_json_errors_name_the_keys(tmp_path):
    data = BUILTIN_PROFILES["h100"].to_dict()
    (tmp_path / "extra.json").write_text(json.dumps(data | {"tflops": 1}))
    with pytest.raises(ValueError, match=r"unknown keys \['tflops'\]"):
        load_profile(tmp_path / "extra.json")
    del data["hbm_bytes"]
    (tmp_path / "missing.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"missing keys \['hbm_bytes'\]"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"--gpu=.*cannot read"):
        load_profile(tmp_path / "bad.json")


def test_profile_checks_values():
    good = BUILTIN_PROFILES["a100-80gb"].to_dict()
    with pytest.raises(ValueError, match=r"mfu=1.5"):
        HardwareProfile(**(good | {"mfu": 1.5}))
    with pytest.raises(ValueError, match=r"d2h_gbps must be > 0"):
        HardwareProfile(**(good | {"d2h_gbps": 0}))
    with pytest.raises(ValueError, match=r"gpus_per_node"):
        HardwareProfile(**(good | {"gpus_per_node": 2.5}))


def test_a_profile_file_with_an_infinite_rate_is_one_line(tmp_path):
    """JSON has no infinity, but Python's json reads ``Infinity``: a profile file holding one was a ValueError of the
    cost model, deep in the planner (a traceback from ``sppo-plan --gpu FILE``)."""
    (tmp_path / "inf.json").write_text(json.dumps(BUILTIN_PROFILES["h100"].to_dict() | {"d2h_gbps": math.inf}))
    with pytest.raises(ValueError, match=r"--gpu=.*: HardwareProfile.d2h_gbps must be a finite number >= 0, got d2h"):
        resolve_profile(str(tmp_path / "inf.json"))


def test_resolve_unknown_name():
    with pytest.raises(ValueError, match=r"--gpu='v100' is neither a built-in profile"):
        resolve_profile("v100")
