"""`PressureLadder`: the `mixed` scheduler's admission mode under KV pressure, normal -> hold -> static and back.

Preemption is the pressure signal: the running set outgrew the KV pool, and a victim's KV is thrown away and
recomputed. The ladder climbs one rung per burst of preemptions; it steps down one rung after `CALM_STEPS` steps
with neither a preemption nor a change of mode, once `FREE_WATERMARK` of the pool is free. It never leaves
`normal` without a preemption. A mode only gates admission (`Scheduler._may_admit`): it changes when a request
runs, never what it computes, so outputs are token for token those of an undegraded run.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Literal

Mode = Literal["normal", "hold", "static"]
MODES: tuple[Mode, ...] = ("normal", "hold", "static")  # the ladder in order; a mode's index is its exported level

# NOTE: `static` is the last resort. Holding back requests that cannot fit whole already stops most of the
# recompute; shutting admission while blocks are free costs steps, so it takes a steady run of preemptions.
WINDOW_STEPS = 32  # preemptions count towards a climb for this many steps
HOLD_AT = 1  # preemptions in the window that climb normal -> hold
STATIC_AT = 8  # preemptions in the window, all while holding, that climb hold -> static
CALM_STEPS = 64  # steps without a preemption before stepping down a rung ...
FREE_WATERMARK = 0.5  # ... with at least this fraction of the KV blocks free

log = logging.getLogger("sluice.scheduler")


class PressureLadder:
    """The mode, moved only by `observe` (once per `mixed` step) and `settle` (the scheduler ran dry).

    Each change logs one INFO line on `sluice.scheduler` (from -> to, and why) and counts in `num_changes`.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.mode: Mode = "normal"
        self.num_changes = 0
        self._step = 0
        self._seen = 0  # the scheduler's preemption total at the last observation
        self._recent: deque[int] = deque()  # the step of each preemption in the window under the current mode
        self._calm_since = 0  # the step of the last preemption or change of mode

    @property
    def level(self) -> int:
        """0 normal, 1 hold, 2 static."""
        return MODES.index(self.mode)

    def observe(self, num_preemptions: int, num_free_blocks: int, num_running: int) -> None:
        """Before a step's admissions, after its running requests took their blocks; `num_preemptions` is the
        scheduler's running total, so this step's preemptions count already."""
        self._step += 1
        new, self._seen = num_preemptions - self._seen, num_preemptions
        if new:
            self._recent.extend([self._step] * new)
            self._calm_since = self._step
        while self._recent and self._recent[0] <= self._step - WINDOW_STEPS:
            self._recent.popleft()
        n = len(self._recent)
        if self.mode == "normal" and n >= HOLD_AT:
            self._change("hold", f"{n} preemption(s) in {WINDOW_STEPS} steps")
        elif self.mode == "hold" and n >= STATIC_AT:
            self._change("static", f"{n} preemptions in {WINDOW_STEPS} steps while holding")
        elif self.mode == "static" and num_running == 0:
            self._change("hold", "the static batch drained")  # NOTE: else a drained `static` would admit one at a time
        elif self.mode != "normal" and self._step - self._calm_since >= CALM_STEPS \
                and num_free_blocks >= FREE_WATERMARK * self.num_blocks:
            self._change(MODES[self.level - 1],
                         f"no preemption in {CALM_STEPS} steps, {num_free_blocks}/{self.num_blocks} KV blocks free")

    def go_on_from(self, num_preemptions: int, num_changes: int) -> None:
        """In an engine that replaces another (`LLMEngine.rebuilt`): its counters go on from that one's; the
        preemptions it had are not new ones."""
        self._seen, self.num_changes = num_preemptions, num_changes

    def settle(self) -> None:
        """Nothing is running or waiting: no pressure is left to wait out."""
        if self.mode != "normal":
            self._change("normal", "nothing left to run")

    def _change(self, mode: Mode, why: str) -> None:
        log.info("scheduler mode %s -> %s: %s", self.mode, mode, why)
        self.mode = mode
        self.num_changes += 1
        self._recent.clear()  # a climb needs preemptions under the new mode ...
        self._calm_since = self._step  # ... and each step down a calm period of its own
