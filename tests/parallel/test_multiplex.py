"""Blocks and K/V groups of a shared unit (the runtime is tested across processes in tests/distributed)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_sppo.parallel.multiplex import block_lengths, group_split


@given(units=st.integers(1, 200), members=st.integers(1, 8), granularity=st.integers(1, 4))
def test_blocks_cover_the_subsequence_evenly(units, members, granularity):
    if units < members:
        with pytest.raises(ValueError, match="cannot be shared by"):
            block_lengths(units * granularity, members, granularity)
        return
    lengths = block_lengths(units * granularity, members, granularity)
    assert sum(lengths) == units * granularity and len(lengths) == members
    assert all(n % granularity == 0 and n > 0 for n in lengths)
    assert max(lengths) - min(lengths) <= granularity


def test_too_short_names_the_settings():
    with pytest.raises(ValueError, match=r"3 tokens cannot be shared by 4 ranks.*num_subsequences.*schedule='seq1f1b'"):
        block_lengths(3, 4, 1)


@given(groups=st.integers(1, 16), members=st.integers(1, 8), data=st.data())
def test_group_split_is_even_with_the_remainder_on_the_owner_first(groups, members, data):
    owner = data.draw(st.integers(0, members - 1))
    split = group_split(groups, members, owner)
    assert sum(split) == groups and len(split) == members
    assert max(split) - min(split) <= 1
    assert split[owner] == max(split)
