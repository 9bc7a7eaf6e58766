"""The link faults of the chaos matrix and the plan that decides, per HTTP request, which
one the fault proxy (:mod:`bench.chaos.proxy`) injects.

A :class:`Fault` is one row of the matrix: a *kind* (what happens), a *target* (which
requests it hits: ``verify`` = ``POST /v1/sessions/{id}/verify``, ``create`` =
``POST /v1/sessions``, ``correction`` = ``POST /v1/sessions/{id}/correction``, the
edge's fetch of a wider support or the full target distribution for its staged
correction) and the 1-based indices ``at`` of the matching requests it hits, counted in
arrival order at one proxy (retries and duplicates count as requests too). Nothing is
random: the same traffic gets the same faults.

Correction requests happen only in sampling mode, when the verify answer's support
cannot decide the correction token; the matrix runs the ``correction`` rows with
sampling only and a client that always needs one (:data:`CORRECTION_CLIENT`).

Kinds, by direction (uplink = client to server, downlink = server to client):

=====================  =========  ==================================================
kind                   direction  what the proxy does with the hit request
=====================  =========  ==================================================
``none``               --         forwards it (the proxy is transparent)
``drop-request``       uplink     resets the client connection, forwards nothing
``drop-response``      downlink   forwards it, the server answers, then resets the
                                  client connection (the client retries with a new
                                  signature; the server's replay cache answers)
``duplicate``          uplink     forwards it twice (same bytes, same nonce: a signed
                                  server refuses the copy with 401 ``replayed_nonce``,
                                  an unsigned one answers it from its replay cache)
                                  and returns the first answer
``reorder``            uplink     holds it until the next matching request has been
                                  forwarded and answered (a block sent ahead, or
                                  another request of a pipeline), or for
                                  ``hold_s`` when none comes; then forwards it
``delay-request``      uplink     forwards it ``seconds`` late (past the client's
                                  per-request timeout: the client has retried)
``delay-response``     downlink   forwards it, holds the answer ``seconds``
``reset-request``      uplink     forwards the head and half the body to the server,
                                  then resets both connections
``reset-response``     downlink   forwards it, writes the answer's head (full
                                  Content-Length) and half its body, then resets
``partition``          both       from the hit request on, for ``seconds``: every
                                  request and every answer is black-holed (held
                                  without an answer, then the connection is reset),
                                  new connections included; with ``refuse``, every
                                  request is reset at once instead (a link that
                                  answers with resets, e.g. a rebooting NAT)
=====================  =========  ==================================================
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

__all__ = ["KINDS", "TARGETS", "CORRECTION_CLIENT", "Fault", "FaultPlan", "correction_rows",
           "fault_matrix", "request_target"]

KINDS = ("none", "drop-request", "drop-response", "duplicate", "reorder", "delay-request",
         "delay-response", "reset-request", "reset-response", "partition")
TARGETS = ("verify", "create", "correction")
_SESSION_POST = re.compile(r"^/v1/sessions/[^/]+/(verify|correction)$")

CORRECTION_CLIENT = {"support_k": 1, "n_proposals": 0}
"""``EdgeClient`` options of the ``correction`` rows: a top-1 support and no proposals
in the verify answer, so every rejection whose target distribution has more than one
token (sampling) needs a correction request (``eps_req`` 0: the full distribution)."""


def request_target(method: str, path: str) -> str | None:
    """``verify``, ``create``, ``correction`` or None (any other request) for
    ``method`` and ``path`` (without the query)."""
    if method != "POST":
        return None
    if path == "/v1/sessions":
        return "create"
    m = _SESSION_POST.match(path)
    return m.group(1) if m else None


@dataclass(frozen=True)
class Fault:
    """One row of the matrix.

    Attributes:
        name: the row label (``chaos.json``'s ``fault``).
        kind: one of :data:`KINDS`.
        target: one of :data:`TARGETS` (``correction``: the row runs sampling
            variants only, with :data:`CORRECTION_CLIENT`).
        at: 1-based indices of the matching requests hit (per proxy).
        seconds: delay (``delay-*``) or partition length (``partition``), seconds.
        expect_error: the documented error (``CloudUnreachable``) is the expected end
            of every run hit (a partition longer than the client waits).
        offline_timeout_s: the client's ``offline_timeout_s`` for this row (None: the
            matrix default).
        refuse: ``partition``: reset every request at once instead of holding it.
        note: shown under the table (e.g. what ``--quick`` replaced).
    """

    name: str
    kind: str
    target: str = "verify"
    at: tuple = (2,)
    seconds: float = 0.0
    expect_error: bool = False
    offline_timeout_s: float | None = None
    refuse: bool = False
    note: str = ""

    def __post_init__(self):
        if self.kind not in KINDS or self.target not in TARGETS:
            raise ValueError(f"unknown fault kind/target {self.kind!r}/{self.target!r}")


class FaultPlan:
    """Decides per request whether ``fault`` hits it; counts what it saw and did.

    ``seen[target]``: matching requests so far; ``fired``: hits so far.
    """

    def __init__(self, fault: Fault):
        self.fault = fault
        self.seen: Counter = Counter()
        self.fired = 0

    def pick(self, method: str, path: str) -> Fault | None:
        """The fault to inject into this request (None: forward it normally)."""
        target = request_target(method, path)
        if target is None:
            return None
        self.seen[target] += 1
        f = self.fault
        if f.kind == "none" or target != f.target or self.seen[target] not in f.at:
            return None
        self.fired += 1
        return f


def correction_rows(timeout_s: float, quick: bool, at: tuple = (1,)) -> list[Fault]:
    """The rows on correction requests (sampling only, :data:`CORRECTION_CLIENT`): every
    kind on the ``at``-th correction requests, a 2 s partition from the first, and
    ``drop-request x3``: the first three dropped, one more than the client's 2 transport
    retries, so the round fails after the verdict and is redone (the resent block is
    answered from the replay cache, the correction fetched again, the token redrawn
    from the same seeded generator). ``quick``: ``drop-request x3`` only (it drops the
    request and exhausts the retries; each row costs ~10 % of the quick run). Delays
    are ``timeout_s + 0.5`` seconds."""
    late, c = timeout_s + 0.5, "correction"
    x3 = Fault("drop-request x3 (correction)", "drop-request", c, (1, 2, 3),
               note="3 drops > 2 transport retries: the round is redone")
    if quick:
        return [x3]
    return [Fault("drop-request (correction)", "drop-request", c, at),
            Fault("drop-response (correction)", "drop-response", c, at),
            Fault("duplicate (correction)", "duplicate", c, at),
            Fault("reorder (correction)", "reorder", c, at),
            Fault("delay-request (correction)", "delay-request", c, at, seconds=late),
            Fault("delay-response (correction)", "delay-response", c, at, seconds=late),
            Fault("reset-request-body (correction)", "reset-request", c, at),
            Fault("reset-response-body (correction)", "reset-response", c, at),
            Fault("partition-2s (correction)", "partition", c, at[:1], seconds=2.0),
            x3]


def fault_matrix(timeout_s: float, quick: bool, at: tuple = (2,)) -> list[Fault]:
    """The rows of ``specrelay bench --chaos``: every kind on verify requests, the drop
    and duplicate kinds on session creation, a 2 s and a 30 s partition (``quick``: 5 s,
    noted), a 30 s partition that outlasts the client's patience (refused
    connections, 1 s offline timeout: every run hit must fail with
    ``CloudUnreachable``), then :func:`correction_rows` (on the first correction
    request of a run; full: the first and the third). Delays are ``timeout_s + 0.5``
    seconds (past the client's per-request timeout)."""
    late = timeout_s + 0.5
    long_s = 5.0 if quick else 30.0
    first = (1,)
    return [
        Fault("none", "none"),
        Fault("drop-request", "drop-request", at=at),
        Fault("drop-response", "drop-response", at=at),
        Fault("duplicate", "duplicate", at=at),
        Fault("reorder", "reorder", at=at),
        Fault("delay-request", "delay-request", at=at, seconds=late),
        Fault("delay-response", "delay-response", at=at, seconds=late),
        Fault("reset-request-body", "reset-request", at=at),
        Fault("reset-response-body", "reset-response", at=at),
        Fault("drop-request (create)", "drop-request", "create", first),
        Fault("drop-response (create)", "drop-response", "create", first),
        Fault("duplicate (create)", "duplicate", "create", first),
        Fault("partition-2s", "partition", at=at[:1], seconds=2.0),
        Fault(f"partition-{long_s:.0f}s", "partition", at=at[:1], seconds=long_s,
              note="--quick: a 5 s partition instead of 30 s" if quick else ""),
        Fault("partition-30s > offline timeout", "partition", at=at[:1], seconds=30.0,
              expect_error=True, offline_timeout_s=1.0, refuse=True,
              note="connections reset, offline_timeout_s 1 s: every run must fail with "
              "CloudUnreachable"),
    ] + correction_rows(timeout_s, quick, first if quick else (1, 3))
