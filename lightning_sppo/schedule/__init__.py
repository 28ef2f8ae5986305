"""Pipeline schedules as data: generate, lower, validate, dry-run and simulate per-rank action lists.

Typical use::

    schedule = build_schedule("seq1f1b", pp=4, num_subsequences=8, num_microbatches=2)
    validate_schedule(schedule, pp=4, num_subsequences=8, num_microbatches=2)
    dry_run(lower(schedule))  # raises ScheduleDeadlock if the ranks would wait on each other
    print(simulate(schedule, {"F": 1.0, "B": 2.0}).bubble_ratio)
"""

from lightning_sppo.schedule.actions import Action, Op
from lightning_sppo.schedule.execute import ScheduleDeadlock, dry_run
from lightning_sppo.schedule.formatting import format_schedule
from lightning_sppo.schedule.generators import (
    SCHEDULES,
    ScheduleGenerator,
    build_schedule,
    forward_only,
    seq1f1b_warmup,
)
from lightning_sppo.schedule.lowering import lower
from lightning_sppo.schedule.msp import msp_phases
from lightning_sppo.schedule.timing import Costs, SimulationResult, simulate
from lightning_sppo.schedule.validate import validate_schedule

__all__ = [
    "SCHEDULES",
    "Action",
    "Costs",
    "Op",
    "ScheduleDeadlock",
    "ScheduleGenerator",
    "SimulationResult",
    "build_schedule",
    "dry_run",
    "format_schedule",
    "forward_only",
    "lower",
    "msp_phases",
    "seq1f1b_warmup",
    "simulate",
    "validate_schedule",
]
