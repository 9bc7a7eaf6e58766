"""The contract of a bench mode: what it is given (:class:`EdgeContext`,
:class:`RunSetup`), what it completes (:class:`BenchRequest`) and what it returns
(:class:`RequestRecord`), and the :class:`BenchMode` base class itself.

A mode turns one prompt into a completion through the real HTTP API (the link emulator
sits in between) and returns a :class:`RequestRecord` whose ``metrics`` is the
per-request dict that :func:`bench.report.aggregation.aggregate` consumes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Hashable, Sequence

from bench.linkem.profiles import Profile
from edge_sdk.protocol.sampling import SamplingConfig

__all__ = ["EdgeContext", "BenchRequest", "RequestRecord", "RunSetup", "BenchMode"]


@dataclass
class EdgeContext:
    """Everything a mode needs on the edge for one run (mode × profile × workload).

    Attributes:
        base_url: the API as the edge sees it (the link emulator's address).
        tokenizer: shared by draft and target.
        drafter: the edge draft model (possibly wrapped to emulate contention) or None.
        signer: request signer (``edge_sdk.protocol.signing.Signer``) or None.
        profile: the emulated network profile (for the latency breakdown).
        sampling: sampling config of every request in the run.
        max_new_tokens: generation cap per request (tokens).
        depth: draft depth (tokens per block) for fixed-depth modes.
        link_bytes: returns ``(uplink_bytes, downlink_bytes)`` delivered by the link
            emulator so far (all HTTP bytes, headers included); None if unknown.
        options: free-form per-mode options (later modes: CAAC gains, ...).
        concurrency: requests in flight at once for concurrent modes (``pipeline`` and
            its baselines, see :class:`ConcurrentMode`); sequential modes ignore it.
    """

    base_url: str
    tokenizer: object
    drafter: object | None
    signer: object | None
    profile: Profile
    sampling: SamplingConfig
    max_new_tokens: int
    depth: int = 4
    link_bytes: Callable[[], tuple[int, int]] | None = None
    options: dict = field(default_factory=dict)
    concurrency: int = 1


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to complete: ``prompt_ids`` already encoded (chat template applied for
    chat workloads); ``seed`` seeds every random draw of the request (edge and cloud)."""

    prompt_id: str
    workload: str
    prompt_ids: tuple[int, ...]
    seed: int


@dataclass
class RequestRecord:
    """Result of one request: ``metrics`` (per-request dict for ``report.aggregate``),
    the generated ``token_ids``, ``text`` and ``finish_reason``."""

    request: BenchRequest
    metrics: dict
    token_ids: list[int]
    text: str
    finish_reason: str


@dataclass(frozen=True)
class RunSetup:
    """What :meth:`BenchMode.setup_run` gets once per bench run: the run's model sources
    (``target``; ``draft`` = the edge's draft source), the model ``dtype``, and the CPU
    ids and thread count of the peer engines (:mod:`bench.modes.peers`): the cloud's
    unless the run names others (``--peer-cpus``, ``--peer-threads``)."""

    target: object
    draft: object
    dtype: str
    peer_cpus: tuple[int, ...] = ()
    peer_threads: int = 1


class BenchMode(ABC):
    """A way of generating a completion. Subclasses set the class attributes and
    implement :meth:`run_request`; :meth:`open`/:meth:`close` bracket a run.

    Class attributes: ``name`` (CLI/results label), ``description``, ``needs_drafter``
    (the edge runs a draft model), ``baseline`` (other modes are compared against it).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    needs_drafter: ClassVar[bool] = True
    baseline: ClassVar[bool] = False
    early_exit: ClassVar[bool] = False      # needs the cloud's early verdicts (FSD)

    def __init__(self, ctx: EdgeContext):
        self.ctx = ctx

    @classmethod
    def setup_run(cls, run: RunSetup) -> None:
        """Once per bench run, before the cloud starts (``run_bench`` calls it for every
        mode of the run): check that the mode can run and note what its cells share
        (e.g. a peer engine's models, loaded on first use). Raise ImportError or
        ValueError with a one-line reason when it cannot run."""

    @classmethod
    def teardown_run(cls) -> None:
        """Once per bench run, after the last cell: free what the run's cells shared."""

    @classmethod
    def warmup_key(cls) -> Hashable:
        """What the bench's one unmeasured warm-up request is shared by: modes with equal
        keys run the same code on both sides (only a policy differs), so one warm-up
        serves them all. Default: the mode's own name (every mode warmed)."""
        return cls.name

    @classmethod
    def run_metrics(cls, per_request: Sequence[dict]) -> dict:
        """Extra run-level metrics from one cell's per-request metrics (merged into the
        cell's ``metrics`` in results.json; default none)."""
        return {}

    async def open(self) -> None:
        """Acquire per-run resources (HTTP sessions, clients)."""

    async def close(self) -> None:
        """Release what :meth:`open` acquired."""

    @abstractmethod
    async def run_request(self, req: BenchRequest) -> RequestRecord:
        """Generate one completion; raise on any protocol failure."""

    async def run(self, reqs: Sequence[BenchRequest],
                  on_done: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
        """Run every request (sequentially by default); ``on_done`` after each."""
        out = []
        for r in reqs:
            rec = await self.run_request(r)
            out.append(rec)
            if on_done:
                on_done(rec)
        return out
