"""``stalwart chaos``: run training under injected faults and measure what they cost.

- ``schedule``: the faults (``Fault``, ``parse_schedule``, ``poisson_schedule``);
- ``supervisor``: runs the command, injects them, restarts it (``Supervisor``);
- ``procs``: finds a command's ranks through ``/proc`` (Linux);
- ``measure``: goodput, lost work and the recovery split from the supervisor's
  record and the run's ``events.jsonl``;
- ``plot``: the PNG (matplotlib, imported when called).

The Young/Daly comparison is in ``stalwart.cli.cmd_chaos``, next to the planner
whose arithmetic it reuses. Nothing here imports the CLI.
"""

from stalwart.chaos.measure import measure, pure_step_time
from stalwart.chaos.schedule import FAULT_KINDS, Fault, parse_schedule, poisson_schedule
from stalwart.chaos.supervisor import (
    DEFAULT_STEP_PATTERN,
    Attempt,
    ChaosRecord,
    Injected,
    Supervisor,
)

__all__ = [
    "DEFAULT_STEP_PATTERN",
    "FAULT_KINDS",
    "Attempt",
    "ChaosRecord",
    "Fault",
    "Injected",
    "Supervisor",
    "measure",
    "parse_schedule",
    "poisson_schedule",
    "pure_step_time",
]
