"""Text grid of a schedule, for error messages and debugging."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_sppo.schedule.actions import Action

__all__ = ["format_schedule"]


def format_schedule(schedule: Sequence[Sequence[Action]]) -> str:
    """One row per rank, one column per position, so a misplaced action is easy to spot.

    Positions are list indices, not time: use ``simulate`` for a timeline.
    """
    cells = [[str(action) for action in actions] for actions in schedule]
    width = max((len(cell) for row in cells for cell in row), default=1)
    length = max((len(row) for row in cells), default=0)
    label = len(f"rank {max(len(cells) - 1, 0)}")
    lines = ["pos".ljust(label) + " | " + " ".join(str(i).ljust(width) for i in range(length))]
    lines += [
        f"rank {rank}".ljust(label) + " | " + " ".join(c.ljust(width) for c in row) for rank, row in enumerate(cells)
    ]
    return "\n".join(line.rstrip() for line in lines)
