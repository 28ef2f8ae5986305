"""The runtime's bytes per token per layer against the planner's, for every recompute mode x K/V spill on/off.

``benchmarks/bytes_per_token.py`` measures one engine step (level 2: the offloader's count of saved units, the
difference of a 4- and a 2-layer model; level 1: the K/V caches' device and host bytes) and computes what the
solver charges with its own functions; they must agree within 5% (they agree exactly today).
"""

from __future__ import annotations

import pytest

from lightning_sppo.model.config import GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def bench(monkeypatch):
    from tests.test_gpu_suite import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bytes_per_token

    return bytes_per_token


@pytest.mark.slow
def test_measured_bytes_per_token_match_the_planner_within_five_percent(bench):
    config = GPTConfig.from_name("tiny-gqa")
    rows = bench.run(config, seq_len=256, n=4, precisions=("fp32", "bf16-mixed"))
    assert len(rows) == 12
    for row in rows:
        for key, predicted in row["predicted"].items():
            measured = row["measured"][key]
            assert abs(measured - predicted) <= 0.05 * max(predicted, 1.0), (row, key)
    by = {(r["precision"], r["recompute"], r["kv_spill"]): r["measured"] for r in rows}
    for precision in ("fp32", "bf16-mixed"):  # the modes really differ, and the spill really moves level 1
        assert by[precision, "full", False]["level2"] < by[precision, "selective", False]["level2"]
        assert by[precision, "selective", False]["level2"] < by[precision, "none", False]["level2"]
        assert by[precision, "none", True]["level1_host"] > 0 == by[precision, "none", False]["level1_host"]
