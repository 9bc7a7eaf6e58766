"""Scoring a faulted run against its fault-free reference, and the table rows.

Definitions (token counts are summed over a row's runs):

* **identical** (runs): the run ended without an exception and its token ids equal the
  reference's (greedy: the same tokens; seeded sampling: the same seed, the same
  draws, the same tokens).
* **lost** (tokens): reference tokens missing from the output. The output is aligned
  with the reference (``difflib.SequenceMatcher``, no junk heuristic); every reference
  token in a *delete* or *replace* span counts. For a run that raised a documented
  error the missing tail (the output is a prefix of the reference, cut short) is not
  counted: the request failed, it did not lose tokens silently.
* **duplicated** (tokens): output tokens the reference does not hold at that position:
  every output token in an *insert* or *replace* span (an output longer than the
  reference, a repeated block, a wrong token).
* **errors** (runs): runs that raised a documented error of the SDK:
  ``edge_sdk.CloudUnreachable`` (the cloud stayed lost longer than
  ``offline_timeout_s``) or ``edge_sdk.transport.RemoteError`` (the API refused a
  request). Any other exception is *undocumented*: it is not counted here but listed in
  :attr:`Row.undocumented`, and ``specrelay bench --chaos`` exits 1 when there is one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Sequence

__all__ = ["RunOutcome", "Row", "score_tokens", "documented", "ROW_KEYS"]

ROW_KEYS = ("fault", "runs", "identical", "lost", "duplicated", "errors")
"""The keys of a ``chaos.json`` row, in order."""


def documented(err: BaseException) -> bool:
    """True for the errors the SDK documents for a failed request."""
    from edge_sdk.results import CloudUnreachable
    from edge_sdk.transport import RemoteError

    return isinstance(err, (CloudUnreachable, RemoteError))


@dataclass
class RunOutcome:
    """One request: the token ids it streamed, the exception it raised (None: it
    finished), its reference's token ids, and the target passes it cost (None: not
    measured, e.g. in a pipeline where passes are shared)."""

    tokens: list
    error: BaseException | None
    reference: list
    passes: int | None = None
    ref_passes: int | None = None


def score_tokens(ref: Sequence[int], out: Sequence[int],
                 failed: bool = False) -> tuple[int, int]:
    """(lost, duplicated) tokens of ``out`` against ``ref`` (module docstring);
    ``failed``: the run raised a documented error (a cut-short tail is not lost)."""
    ops = SequenceMatcher(None, list(ref), list(out), autojunk=False).get_opcodes()
    lost = dup = 0
    for tag, i1, i2, j1, j2 in ops:
        if tag in ("delete", "replace"):
            tail = failed and tag == "delete" and i2 == len(ref) and j1 == len(out)
            lost += 0 if tail else i2 - i1
        if tag in ("insert", "replace"):
            dup += j2 - j1
    return lost, dup


@dataclass
class Row:
    """The outcome of one fault over all its runs (``chaos.json`` row: :meth:`as_dict`),
    plus what the table's notes show: faults injected (``injected``: requests hit),
    requests of the fault's ``target`` the proxies saw (``seen``), extra target passes
    of the sequential runs (a replayed block must cost none), undocumented exceptions.
    ``expect_hits``: the row injects faults (kind other than ``none``); one that ran
    but hit nothing proves nothing (:attr:`never_fired`)."""

    fault: str
    runs: int = 0
    identical: int = 0
    lost: int = 0
    duplicated: int = 0
    errors: int = 0
    injected: int = 0
    extra_passes: int = 0
    undocumented: list = field(default_factory=list)
    note: str = ""
    target: str = "verify"
    expect_hits: bool = False
    seen: int = 0

    @property
    def never_fired(self) -> bool:
        """The row ran and should have injected faults, but none hit a request."""
        return self.expect_hits and self.runs > 0 and self.injected == 0

    def add(self, o: RunOutcome) -> None:
        """Count one run."""
        self.runs += 1
        err = o.error
        if err is not None and not documented(err):
            self.undocumented.append(f"{type(err).__name__}: {err}")
        failed = err is not None and documented(err)
        self.errors += int(failed)
        lost, dup = score_tokens(o.reference, o.tokens, failed)
        self.lost, self.duplicated = self.lost + lost, self.duplicated + dup
        self.identical += int(err is None and list(o.tokens) == list(o.reference))
        if o.passes is not None and o.ref_passes is not None:
            self.extra_passes += max(0, o.passes - o.ref_passes)

    def as_dict(self) -> dict:
        """The ``chaos.json`` row: exactly :data:`ROW_KEYS`."""
        return {k: getattr(self, k) for k in ROW_KEYS}
