"""How a run's cells are labelled in ``results.json`` (``runs[].profile`` /
``runs[].workload``), and how to read the labels back.

* a concurrent run at concurrency C on profile P is reported under the profile label
  ``P@cC`` (``weak@c8``), so runs stay unique per (mode, profile, workload) and ratio
  rows compare modes at the same profile *and* concurrency (the schema has no other
  slot for it);
* ``P+slow`` is link P with edge contention (every draft forward slower from a point in
  each run, see :mod:`bench.contention`): ratios compare modes under the same link and
  the same contention;
* the workload label is the workload name, suffixed with the sampling variant when
  several variants run (``mtbench/greedy``, ``mtbench/sample``).
"""
from __future__ import annotations

import re
from typing import Sequence

__all__ = ["SLOW_SUFFIX", "point_label", "split_point", "split_contention",
           "workload_label"]

SLOW_SUFFIX = "+slow"
"""Profile-label suffix of a contention variant (``medium+slow``)."""

_POINT = re.compile(r"^(?P<profile>.+)@c(?P<c>\d+)$")


def point_label(profile: str, concurrency: int) -> str:
    """``weak``, 8 → ``weak@c8`` (the ``profile`` label of a concurrent run)."""
    return f"{profile}@c{int(concurrency)}"


def split_point(label: str) -> tuple[str, int | None]:
    """``weak@c8`` → ("weak", 8); a plain profile label → (label, None)."""
    m = _POINT.match(label)
    return (m["profile"], int(m["c"])) if m else (label, None)


def split_contention(label: str) -> tuple[str, bool]:
    """``medium+slow`` → ("medium", True); ``medium`` → ("medium", False)."""
    if label.endswith(SLOW_SUFFIX):
        return label[: -len(SLOW_SUFFIX)], True
    return label, False


def workload_label(workload: str, sampling: str, all_sampling: Sequence[str]) -> str:
    """Workload label in results: the workload name, suffixed with the sampling variant
    when several variants run (``mtbench/greedy``, ``mtbench/sample``)."""
    return workload if len(all_sampling) == 1 and sampling == "greedy" else f"{workload}/{sampling}"
