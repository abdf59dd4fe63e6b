"""A clock the test moves: code that times itself with an injected `now` (gptpar.clock.DeviceClock off a GPU) reads
exact spans, so a test of what it does with them needs no wall-clock margin."""

from __future__ import annotations


class ManualClock:
    """`now()` reads the seconds `advance` has added up; dyadic steps (0.25, 1.5) keep every span exact."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds
