"""Edge contention (RAPID: the draft model shares the robot's core with other work).

``edge_slowdown=F, slowdown_at_s=T`` wraps the drafter in :class:`SlowdownDrafter`
(every draft forward started ``T`` seconds or more after the start of a run takes ``F``
times as long); ``edge_load=N`` starts ``N`` busy-loop processes pinned to the edge
CPU(s) at ``T`` (:class:`EdgeLoad`). A *run* is one (mode, profile, workload) cell; the
contention clock restarts with every run. With ``<profile>+slow`` variants in the run
(:mod:`bench.report.labels`) only those are contended (:func:`contention`).
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

from bench.report.labels import split_contention
from edge_sdk.drafters.base import Drafter

__all__ = ["DEFAULT_SLOWDOWN", "contention", "SlowdownDrafter", "EdgeLoad"]

DEFAULT_SLOWDOWN = 3.0
"""Draft-forward slowdown factor of a ``+slow`` variant when ``--edge-slowdown`` is 1."""


def contention(edge_slowdown: float, profile_names: Sequence[str]
               ) -> tuple[float, Callable[[str], bool]]:
    """``(factor, contended)``: the draft-forward slowdown factor of the run
    (``edge_slowdown``, else :data:`DEFAULT_SLOWDOWN` when a ``+slow`` variant runs, else
    1) and whether a profile label is contended (only the ``+slow`` variants when the
    run has any, else every profile; none at factor 1)."""
    variants = any(split_contention(p)[1] for p in profile_names)
    factor = (edge_slowdown if edge_slowdown > 1.0 else
              DEFAULT_SLOWDOWN if variants else 1.0)

    def contended(pname: str) -> bool:
        return factor > 1.0 and (not variants or split_contention(pname)[1])

    return factor, contended


class SlowdownDrafter(Drafter):
    """Wraps a :class:`Drafter`; once ``at_s`` seconds have passed since the last
    :meth:`restart_clock`, every draft forward (``sync``/``step``) is followed by a sleep
    of ``(factor - 1)`` times its measured duration, so it takes ``factor`` times as
    long (emulated edge contention, e.g. a robot's other workloads).

    Attributes: ``slowed_calls`` (forwards slowed), ``added_s`` (seconds slept).
    """

    def __init__(self, inner: Drafter, factor: float, at_s: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter):
        if factor < 1.0:
            raise ValueError("slowdown factor must be >= 1")
        if at_s < 0:
            raise ValueError("slowdown_at_s must be >= 0 s")
        self.inner, self.factor, self.at_s, self.clock = inner, float(factor), float(at_s), clock
        self.vocab_size = inner.vocab_size
        self.t0 = clock()
        self.slowed_calls = 0
        self.added_s = 0.0

    def restart_clock(self) -> None:
        """Start counting ``at_s`` from now (called at the start of every run)."""
        self.t0 = self.clock()

    @property
    def active(self) -> bool:
        """True once the slowdown applies."""
        return self.factor > 1.0 and self.clock() - self.t0 >= self.at_s

    def _timed(self, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        if self.active:
            extra = (self.factor - 1.0) * (time.perf_counter() - t)
            time.sleep(extra)
            self.slowed_calls += 1
            self.added_s += extra
        return out

    def sync(self, context):
        return self._timed(self.inner.sync, context)

    def step(self, token: int):
        return self._timed(self.inner.step, token)

    def cache_len(self) -> int:
        return self.inner.cache_len()

    def stop_prefill(self, on: bool) -> None:
        self.inner.stop_prefill(on)

    def fork(self) -> "SlowdownDrafter":
        """A fork of the inner drafter under the same contention clock."""
        f = SlowdownDrafter(self.inner.fork(), self.factor, self.at_s, self.clock)
        f.t0 = self.t0
        return f


class EdgeLoad:
    """``n`` busy-loop processes pinned to ``cpus`` (competing edge workloads), started
    ``at_s`` seconds after :meth:`start` and killed by :meth:`stop`."""

    def __init__(self, n: int, cpus: Sequence[int] | None, at_s: float = 0.0):
        self.n, self.cpus, self.at_s = int(n), list(cpus) if cpus else None, float(at_s)
        self.procs: list[subprocess.Popen] = []
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def _spawn(self) -> None:
        pin = f"os.sched_setaffinity(0, {set(self.cpus)!r})\n" if self.cpus else ""
        code = f"import os\n{pin}while True:\n    pass\n"
        with self._lock:
            if self._stopped:
                return
            for _ in range(self.n):
                self.procs.append(subprocess.Popen([sys.executable, "-c", code],
                                                   stdin=subprocess.DEVNULL))

    def start(self) -> "EdgeLoad":
        self._stopped = False
        if self.n <= 0:
            return self
        if self.at_s <= 0:
            self._spawn()
        else:
            self._timer = threading.Timer(self.at_s, self._spawn)
            self._timer.daemon = True
            self._timer.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._timer is not None:
                self._timer.cancel()
            for p in self.procs:
                p.kill()
            for p in self.procs:
                p.wait()
            self.procs = []
