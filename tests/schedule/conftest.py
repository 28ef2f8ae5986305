"""Helpers for schedule tests: schedules written as action strings, and hypothesis strategies."""

from __future__ import annotations

from hypothesis import strategies as st

from lightning_sppo.schedule import Action, Op


def parse(*rows: str) -> list[list[Action]]:
    """One string per rank, actions separated by spaces: ``parse("F0.0 B0.0", "F0.0 B0.0")``."""
    return [[Action.from_str(token) for token in row.split()] for row in rows]


def compute_only(schedule: list[list[Action]]) -> list[list[Action]]:
    return [[a for a in actions if a.op in (Op.F, Op.B)] for actions in schedule]


def sizes(max_pp: int = 8, max_n: int = 16, max_m: int = 4):
    """(pp, num_subsequences, num_microbatches) in the range the schedules are guaranteed for."""
    return st.tuples(st.integers(1, max_pp), st.integers(1, max_n), st.integers(1, max_m))
