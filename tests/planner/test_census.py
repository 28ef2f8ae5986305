"""The census (``planner.census``): what each pass does besides GEMMs and attention, counted from the code."""

from __future__ import annotations

import pytest

from lightning_sppo.model.config import GPTConfig
from lightning_sppo.planner.census import (
    PRECISIONS,
    census,
    counts_to_dict,
    run_census,
    structure_of,
    widths_of,
)
from lightning_sppo.planner.census_table import TABLE

GPT_1B = GPTConfig.from_name("gpt-1b")


def test_the_table_has_every_registered_structure_under_every_precision():
    structures = {structure_of(GPTConfig.from_name(name)) for name in GPTConfig.available()}
    assert len(TABLE) == len(structures) * len(PRECISIONS)


def test_what_the_census_counts_for_a_layer_of_gpt_1b():
    """Byte and op counts that follow from the code (gpt-1b: MHA, SwiGLU, RMSNorm, bf16 autocast, fp32 residual)."""
    counts = census(structure_of(GPT_1B), "autocast")
    engine = counts.engine["none"]
    widths = widths_of(GPT_1B)
    # A later backward adds each weight's bf16 gradient cast to fp32 and summed into .grad: 2+4 and 4+4+4 bytes.
    assert engine["backward"].per_param == pytest.approx(18.0, abs=0.05)
    assert engine["forward"].per_param == pytest.approx(6.0, abs=0.05)  # the first forward casts fp32 -> bf16
    # dK/dV of the prefix added into the fp32 buffers: read fp32 and bf16, write fp32, for K and V (kv width).
    assert sum(engine["backward_prefix"].per_prefix.values()) == pytest.approx(20.0)
    assert engine["forward_prefix"].bytes(widths, 1) > engine["forward"].bytes(widths, 1)  # the merges over the prefix
    # dK/dV are not zeroed per step any more: only where a backward first adds into them (in its own counts)
    assert counts.step.per_token.get("q", 0.0) == 0.0
    full, none = counts.engine["full"], counts.engine["none"]
    assert full["forward"].saved < none["forward"].saved and full["backward"].ops > none["backward"].ops
    assert counts.plain_saved.bytes(widths, 1) > 0 and counts.head_backward.per_token_chunk  # slices' full gradients


@pytest.mark.slow
def test_the_table_is_what_the_code_counts_now():
    """The table is the census of the code as it is: a change that adds a kernel or a byte to a pass must regenerate
    it (``python -m lightning_sppo.planner.census``)."""
    key = "autocast:" + ",".join(str(part) for part in structure_of(GPT_1B))
    fresh = counts_to_dict(run_census(structure_of(GPT_1B), "autocast"))
    assert fresh == TABLE[key]
