"""Benchmark modes: how the edge produces a completion, behind one pluggable registry.

A mode turns one prompt into a completion through the real HTTP API (the link emulator
sits in between) and returns a :class:`RequestRecord` whose ``metrics`` is the
per-request dict that :func:`bench.report.aggregate` consumes.

Built-in modes:

* ``cloud-ar`` (baseline) — the cloud generates with the target alone and streams the
  tokens (``POST /v1/sessions/{id}/generate``, see ``cloud_api/stream.py``); the edge
  only reads. One target pass per token.
* ``standard-sd`` (baseline) — standard edge-cloud speculative decoding:
  :class:`edge_sdk.EdgeClient` ``mode="standard"`` uploads the full draft distribution
  ``q`` (float64, ``V`` values per draft position) and the cloud draws corrections.
* ``specrelay`` — the compact AsymSpec protocol (``mode="asym"``): ``(token, q(token))``
  per position on the uplink, staged correction on the edge; fixed depth ``--depth``.

Concurrent modes (:class:`ConcurrentMode`, C = ``ctx.concurrency`` requests in
flight, one shared draft worker; reported under the profile label ``<profile>@c<C>``,
see :mod:`bench.pipeline`):

* ``pipeline`` — the confirmed-prefix pipeline: one client/scheduler, cloud re-batching.
* ``no-pipeline``, ``runahead`` (NPDG), ``standard-sd-concurrent`` (baselines: requests
  run independently, no cross-request re-batching).
* ``pipeline-standard`` — ablation: the pipeline with the full-q standard protocol.

Peer engines (:mod:`bench.peers`, registered on the first mode lookup, not on
import): ``llamacpp-ar``, ``llamacpp-spec`` (llama.cpp through ``xllamacpp``, the
``[bench]`` extra), ``hf-ar``, ``hf-assisted`` (transformers ``generate``), run on the
cloud's CPUs with the cloud's thread count, without the link emulator.

Adding a mode (CAAC, IPDG, a multi-request pipeline, ...)::

    @register_mode
    class MyMode(BenchMode):
        name = "my-mode"
        description = "..."
        async def run_request(self, req: BenchRequest) -> RequestRecord: ...

:meth:`BenchMode.run` (sequential by default) may be overridden to run many requests
concurrently; such a mode should put ``start_s``/``end_s`` in each request's metrics so
throughput is computed over the makespan.

Latency breakdown (``metrics["breakdown_s"]``, seconds summed over the request, see
:func:`breakdown`): ``draft`` = edge draft compute (slowdown included), ``verify`` =
target compute reported by the cloud, ``upload``/``download`` = the link model's time
for the bytes that crossed the emulator (serialisation ``bytes*8/bandwidth`` plus the
one-way delay ``rtt/2`` per HTTP exchange), ``wait`` = the rest of the wall time
(queueing, jitter and loss stalls, prompt prefill, HTTP/msgpack/signing overhead,
edge-side bookkeeping). The five phases sum to ``wall_s`` (unless the modelled link
time alone exceeds it; ``wait`` is never negative).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Sequence

import aiohttp
import msgpack

from bench.linkem import Profile
from edge_sdk.protocol import wire
from edge_sdk.protocol.sampling import SamplingConfig
from edge_sdk.transport import MSGPACK, RemoteError, Transport

__all__ = [
    "EdgeContext", "BenchRequest", "RequestRecord", "BenchMode", "RecordingTransport",
    "MODES", "register_mode", "get_mode", "mode_names", "breakdown",
    "CloudARMode", "StandardSDMode", "SpecRelayMode", "CloudStreamClient",
    "ConcurrentMode", "PipelineMode", "NoPipelineMode", "RunaheadMode",
    "StandardSDConcurrentMode", "PipelineStandardMode", "TaggingTransport",
    "RunSetup", "PLUGIN_MODULES", "load_plugins",
]


# --------------------------------------------------------------------------- plumbing


@dataclass
class HttpCall:
    """One HTTP exchange seen by :class:`RecordingTransport` (bytes = message bodies)."""

    method: str
    path: str
    up_bytes: int
    down_bytes: int
    t0: float
    t1: float


class RecordingTransport(Transport):
    """:class:`edge_sdk.transport.Transport` that logs every exchange in :attr:`calls`
    (body sizes in bytes, ``time.perf_counter`` seconds)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.calls: list[HttpCall] = []

    async def request(self, method: str, path: str, body: bytes = b"",
                      content_type: str = MSGPACK) -> tuple[bytes, str]:
        t0 = time.perf_counter()
        data, ct = await super().request(method, path, body, content_type)
        self.calls.append(HttpCall(method, path, len(body), len(data), t0,
                                   time.perf_counter()))
        return data, ct


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
        depth: draft depth gamma (tokens per block) for fixed-depth modes.
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


def breakdown(wall_s: float, draft_s: float, verify_s: float, exchanges: int,
              link_up_bytes: int, link_down_bytes: int, profile: Profile) -> dict:
    """Split a request's wall time (s) into the five phases of ``report.BREAKDOWN_PHASES``.

    ``upload = exchanges * rtt/2 + link_up_bytes*8/uplink_bps`` and likewise
    ``download`` (the link emulator's model for the bytes it carried); ``wait`` is what
    remains of ``wall_s`` after draft, verify, upload and download (>= 0). Seconds.
    """
    one_way = profile.rtt_s / 2.0
    up = exchanges * one_way + (link_up_bytes * 8.0 / profile.uplink_bps
                                if profile.uplink_bps else 0.0)
    down = exchanges * one_way + (link_down_bytes * 8.0 / profile.downlink_bps
                                  if profile.downlink_bps else 0.0)
    wait = max(0.0, wall_s - draft_s - verify_s - up - down)
    return {"draft": draft_s, "upload": up, "wait": wait, "verify": verify_s,
            "download": down}


class _LinkMeter:
    """Link-emulator byte counters around one request."""

    def __init__(self, ctx: EdgeContext):
        self.f = ctx.link_bytes
        self.start = self.f() if self.f else (0, 0)

    def delta(self, fallback_up: int, fallback_down: int) -> tuple[int, int]:
        if not self.f:
            return fallback_up, fallback_down
        up, down = self.f()
        return up - self.start[0], down - self.start[1]


@dataclass(frozen=True)
class RunSetup:
    """What :meth:`BenchMode.setup_run` gets once per bench run: the run's model sources
    (``target``; ``draft`` = the edge's draft source), the model ``dtype``, and the
    cloud's CPU ids and thread count (engines that stand in for the cloud, the peer
    modes of :mod:`bench.peers`, run on these)."""

    target: object
    draft: object
    dtype: str
    cloud_cpus: tuple[int, ...] = ()
    cloud_threads: int = 1


# --------------------------------------------------------------------------- registry


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


MODES: dict[str, type[BenchMode]] = {}
"""Mode name → class. Fill with :func:`register_mode`."""

PLUGIN_MODULES = ("bench.peers",)
"""Modules that register more modes, imported on first lookup (:func:`load_plugins`),
not when ``edge_sdk`` or this module is imported."""
_plugins_loaded = False


def load_plugins() -> None:
    """Import :data:`PLUGIN_MODULES` once (they call :func:`register_mode`)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    import importlib

    for mod in PLUGIN_MODULES:
        importlib.import_module(mod)


def register_mode(cls: type[BenchMode]) -> type[BenchMode]:
    """Class decorator adding a :class:`BenchMode` subclass to :data:`MODES` by its
    ``name``. Raises ValueError for an empty or already registered name."""
    if not cls.name:
        raise ValueError("a bench mode needs a name")
    if cls.name in MODES and MODES[cls.name] is not cls:
        raise ValueError(f"bench mode {cls.name!r} is already registered")
    MODES[cls.name] = cls
    return cls


def get_mode(name: str) -> type[BenchMode]:
    """The mode class for ``name``. Raises ValueError listing the known modes."""
    if name not in MODES:
        load_plugins()
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown bench mode {name!r}; choose from {mode_names()}") from None


def mode_names() -> list[str]:
    """Registered mode names (plugins included), in registration order."""
    load_plugins()
    return list(MODES)


# --------------------------------------------------------------------------- speculative


class _SpeculativeMode(BenchMode):
    """EdgeClient rounds; ``client_mode`` picks the protocol. ``client_kw`` are
    :class:`edge_sdk.EdgeClient` options (``ctx.options["client"]`` overrides them); a
    controller given by name becomes ONE object serving every request of the run
    (requests run one after another), so learning controllers keep what they learned.
    ``fixed_depth`` overrides ``--depth``; ``ngram``: the n-gram drafter fronts the
    model drafter."""

    client_mode: ClassVar[str] = "asym"
    client_kw: ClassVar[dict] = {}
    fixed_depth: ClassVar[int | None] = None
    ngram: ClassVar[bool] = False

    async def open(self) -> None:
        from edge_sdk.client import EdgeClient
        from edge_sdk.control import make_controller

        c = self.ctx
        kw = {**self.client_kw, **c.options.get("client", {})}
        if isinstance(kw.get("controller"), str) and kw["controller"] != "fixed":
            kw["controller"] = make_controller(kw["controller"],
                                               **kw.pop("controller_kw", {}) or {})
        drafter = c.drafter
        if self.ngram and drafter is not None:
            from edge_sdk.drafters.ngram import NgramDrafter

            drafter = NgramDrafter(base=drafter)
        self.transport = RecordingTransport(c.base_url, signer=c.signer)
        self.client = EdgeClient(c.base_url, drafter, c.tokenizer,
                                 depth=self.fixed_depth or c.depth, mode=self.client_mode,
                                 signer=c.signer, chat=False, transport=self.transport, **kw)

    async def close(self) -> None:
        await self.client.close()

    async def run_request(self, req: BenchRequest) -> RequestRecord:
        c = self.ctx
        self.transport.calls.clear()
        meter = _LinkMeter(c)
        trace: list[dict] = []
        res = await self.client.generate(prompt_ids=list(req.prompt_ids),
                                         sampling=c.sampling, on_round=trace.append,
                                         max_new_tokens=c.max_new_tokens, seed=req.seed)
        m = dict(res.metrics, round_trace=trace)
        calls = self.transport.calls
        up, down = meter.delta(m["uplink_bytes"], m["downlink_bytes"])
        m.update(link_uplink_bytes=up, link_downlink_bytes=down, http_exchanges=len(calls),
                 prompt_tokens=len(req.prompt_ids),
                 breakdown_s=breakdown(m["wall_s"], m["draft_seconds"], m["target_seconds"],
                                       len(calls), up, down, c.profile))
        return RequestRecord(req, m, list(res.token_ids), res.text, res.finish_reason)


@register_mode
class CloudARMode(BenchMode):
    """Target-only autoregressive generation in the cloud, tokens streamed down."""

    name = "cloud-ar"
    description = "cloud target alone, streamed tokens (one target pass per token)"
    needs_drafter = False
    baseline = True

    async def open(self) -> None:
        c = self.ctx
        self.client = CloudStreamClient(c.base_url, c.tokenizer, signer=c.signer)

    async def close(self) -> None:
        await self.client.close()

    async def run_request(self, req: BenchRequest) -> RequestRecord:
        c = self.ctx
        meter = _LinkMeter(c)
        res = await self.client.generate(list(req.prompt_ids), c.sampling,
                                         c.max_new_tokens, req.seed)
        m = res["metrics"]
        up, down = meter.delta(m["uplink_bytes"], m["downlink_bytes"])
        m.update(link_uplink_bytes=up, link_downlink_bytes=down,
                 prompt_tokens=len(req.prompt_ids),
                 breakdown_s=breakdown(m["wall_s"], 0.0, m["target_seconds"],
                                       m["http_exchanges"], up, down, c.profile))
        return RequestRecord(req, m, res["token_ids"], res["text"], res["finish_reason"])


@register_mode
class StandardSDMode(_SpeculativeMode):
    """Baseline edge-cloud SD: full q uploaded per draft position."""

    name = "standard-sd"
    description = "standard edge-cloud SD: full draft distribution on the uplink"
    baseline = True
    client_mode = "standard"


@register_mode
class SpecRelayMode(_SpeculativeMode):
    """The compact asymmetric protocol at a fixed depth."""

    name = "specrelay"
    description = "AsymSpec compact protocol, fixed depth"
    client_mode = "asym"


@register_mode
class SpecRelayAheadMode(_SpeculativeMode):
    """The compact protocol at a fixed depth with pipelined verification: IPDG drafts
    the next block while one is verified and sends it ahead (``send_ahead``), so the
    cloud verifies back to back on proactive hits."""

    name = "sr-ahead"
    description = "specrelay + IPDG + blocks sent ahead (pipelined verification)"
    client_mode = "asym"
    client_kw = {"proactive": "ipdg", "send_ahead": True}


# --------------------------------------------------------------------------- cloud-ar client


class CloudStreamClient:
    """Client of the streaming target-only route (``cloud_api/stream.py``).

    Args:
        base_url: the API, e.g. ``http://127.0.0.1:8000``.
        tokenizer: for the tokenizer fingerprint and the committed text.
        signer: request signer or None (unauthenticated server).
        timeout_s: whole-request timeout in seconds.
    """

    def __init__(self, base_url: str, tokenizer, signer=None, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.tokenizer, self.signer = tokenizer, signer
        self.transport = RecordingTransport(base_url, signer=signer, timeout_s=timeout_s)
        self._http: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def close(self) -> None:
        await self.transport.close()
        if self._http is not None:
            await self._http.close()

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig | None = None,
                       max_new_tokens: int = 128, seed: int = 0) -> dict:
        """Create a session and stream its completion.

        Returns ``{"token_ids", "text", "finish_reason", "metrics"}``; ``metrics`` holds
        the per-request fields of ``report.aggregate`` (``committed_tokens``, ``wall_s``,
        ``ttft_s``, ``token_times_s`` (s since start), ``uplink_bytes``/``downlink_bytes``
        (bodies), ``target_passes``, ``target_seconds``, ``http_exchanges``).
        Raises :class:`RemoteError` when the API refuses.
        """
        from edge_sdk.commit import Committer
        from edge_sdk.models import tokenizer_fingerprint
        from cloud_api.stream import MSG_DONE, MSG_TOKEN

        cfg = sampling or SamplingConfig()
        self.transport.calls.clear()
        t_start = time.perf_counter()
        body = wire.pack({"prompt_ids": list(prompt_ids), "sampling": cfg.to_dict(),
                          "seed": seed, "max_new_tokens": max_new_tokens,
                          "tokenizer_hash": tokenizer_fingerprint(self.tokenizer)})
        data, _ = await self.transport.request("POST", "/v1/sessions", body)
        info = wire.unpack(data)
        sid = int(info["session_id"])
        committer = Committer(self.tokenizer, max_new_tokens, info.get("eos_token_ids", []))
        path = f"/v1/sessions/{sid}/generate"
        headers = dict(self.signer.headers("POST", path, b"")) if self.signer else {}
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=self._timeout)
        times: list[float] = []
        ties: list[int] = []           # generated-token indices chosen at a near-tie
        target_s, passes, down, t_first = 0.0, 0, 0, None
        server_reason = None
        try:
            async with self._http.post(self.base_url + path, data=b"",
                                       headers=headers) as r:
                if r.status >= 400:
                    raw = await r.read()
                    try:
                        import json

                        parsed = json.loads(raw)
                    except ValueError:
                        parsed = None
                    raise RemoteError(r.status, parsed, raw[:200].decode("utf8", "replace"))
                unpacker = msgpack.Unpacker(raw=False)
                async for chunk in r.content.iter_any():
                    down += len(chunk)
                    unpacker.feed(chunk)
                    now = time.perf_counter()
                    for item in unpacker:
                        if item[0] == MSG_TOKEN:
                            target_s += float(item[2])
                            passes += 1
                            if not committer.done:
                                if len(item) > 3 and item[3]:
                                    ties.append(len(committer.token_ids))
                                committer.push(int(item[1]))
                                times.append(now - t_start)
                                t_first = t_first or now
                        elif item[0] == MSG_DONE:
                            server_reason = item[1]
            t_end = time.perf_counter()
        finally:
            try:
                await self.transport.request("DELETE", f"/v1/sessions/{sid}")
            except Exception:  # noqa: BLE001 - best effort; the TTL evicts anyway
                pass
        finish = committer.finish_reason or server_reason or "length"
        calls = self.transport.calls
        up_b = sum(c.up_bytes for c in calls)
        down_b = sum(c.down_bytes for c in calls) + down
        n = len(committer.token_ids)
        t_first = t_first or t_end
        m = {"committed_tokens": n, "wall_s": t_end - t_start, "ttft_s": t_first - t_start,
             "decode_s": t_end - t_first if n > 1 else 0.0, "token_times_s": times,
             "drafted_tokens": 0, "accepted_tokens": 0, "rounds": 0,
             "uplink_bytes": up_b, "downlink_bytes": down_b, "target_passes": passes,
             "target_seconds": target_s, "wasted_draft_tokens": 0,
             "correction_mode_counts": {"bounded": 0, "proposal": 0, "full": 0},
             "tv_budget_spent": 0.0, "draft_seconds": 0.0,
             "near_tie_tokens": len(ties), "near_tie_positions": ties,
             "http_exchanges": len(calls) + 1}
        return {"token_ids": list(committer.token_ids), "text": committer.text,
                "finish_reason": finish, "metrics": m}


# --------------------------------------------------------------------------- adaptive


class _AdaptiveMode(_SpeculativeMode):
    """The compact protocol with a depth controller (RAPID; UCB-SpecStop) and/or proactive
    drafting (RAPID); compared by :mod:`bench.adaptive` only (no generic
    ratio rows)."""

    adaptive: ClassVar[bool] = True


def _adaptive_mode(name: str, description: str, baseline: bool = False, **attrs) -> type:
    """Register an :class:`_AdaptiveMode` subclass (``attrs``: ``client_kw``,
    ``fixed_depth``, ``ngram``)."""
    cls_name = "".join(p.capitalize() for p in name.replace("-", " ").split()) + "Mode"
    return register_mode(type(cls_name, (_AdaptiveMode,), {
        "name": name, "description": description, "baseline": baseline,
        "__doc__": description, **attrs}))


ADAPTIVE_MODES = [
    _adaptive_mode("sr-heuristic", "specrelay, transformers' heuristic depth (+2 full "
                   "accept, -1 else)", client_kw={"controller": "heuristic"}),
    _adaptive_mode("caac", "specrelay, CAAC depth controller (RAPID), stop-and-wait",
                   client_kw={"controller": "caac"}),
    _adaptive_mode("sr-ucb", "specrelay, UCB-SpecStop depth bandit (delay-bucket context)",
                   client_kw={"controller": "ucb-specstop"}),
    _adaptive_mode("rapid", "specrelay, CAAC + IPDG (interruptible proactive drafting)",
                   client_kw={"controller": "caac", "proactive": "ipdg"}),
    _adaptive_mode("rapid-npdg", "specrelay, CAAC + NPDG (non-interruptible proactive "
                   "baseline)", client_kw={"controller": "caac", "proactive": "npdg"}),
    _adaptive_mode("ipdg", "specrelay, fixed depth --depth + IPDG (interruptible "
                   "proactive drafting)", client_kw={"proactive": "ipdg"}),
    _adaptive_mode("npdg", "baseline: fixed depth --depth + NPDG (proactive drafting that "
                   "runs to its planned depth whatever the verdict)", baseline=True,
                   client_kw={"proactive": "npdg"}),
    _adaptive_mode("stop-and-wait", "baseline: fixed depth --depth, no proactive drafting "
                   "(the edge idles while a block is verified)", baseline=True),
    *[_adaptive_mode(f"fixed-{n}", f"baseline: stop-and-wait at depth {n} (candidates for "
                     "best-fixed)", baseline=True, fixed_depth=n) for n in range(1, 9)],
    _adaptive_mode("sr-ngram", "specrelay, prompt-lookup n-gram drafts, model where no "
                   "match", ngram=True),
]
"""The adaptive modes: controllers, proactive drafting, fixed depths, n-gram."""


# --------------------------------------------------------------------------- concurrent

_REQUEST_CALLS: contextvars.ContextVar = contextvars.ContextVar("specrelay_bench_calls",
                                                                default=None)


class TaggingTransport(Transport):
    """:class:`Transport` that files every exchange (:class:`HttpCall`) under the request
    that made it: the list in the asyncio context variable set by
    :meth:`ConcurrentMode.run` for that request (tasks a request spawns inherit it), so
    concurrent requests sharing one client and connection pool are told apart."""

    async def request(self, method: str, path: str, body: bytes = b"",
                      content_type: str = MSGPACK) -> tuple[bytes, str]:
        t0 = time.perf_counter()
        data, ct = await super().request(method, path, body, content_type)
        calls = _REQUEST_CALLS.get()
        if calls is not None:
            calls.append(HttpCall(method, path, len(body), len(data), t0, time.perf_counter()))
        return data, ct


@dataclass
class _Lane:
    """One request slot of a concurrent run: the client its requests go through."""

    client: object
    own: bool = True            # close the client with the mode


class ConcurrentMode(BenchMode):
    """C requests in flight at once (``ctx.concurrency``) from one edge.

    :meth:`run` keeps C *lanes* busy: each lane takes the next request as soon as its
    previous one finishes (a closed loop; the runner gives a cell whole waves of C
    requests). All draft compute of the run goes through ONE single-thread worker
    (:class:`bench.pipeline.BusyExecutor`: the edge core, its busy seconds give
    the edge utilisation). Each request's metrics carry ``start_s``/``end_s`` (one clock)
    so ``report.aggregate`` computes throughput over the makespan.

    Subclasses choose the client layout (:meth:`_make_lanes`) and the cloud's max batch
    during their runs (:meth:`server_max_batch`; the runner applies it).
    """

    concurrent: ClassVar[bool] = True
    client_kw: ClassVar[dict] = {}

    def __init__(self, ctx: EdgeContext):
        super().__init__(ctx)
        self.concurrency = max(1, int(ctx.concurrency or 1))
        self.worker = None
        self.lanes: list[_Lane] = []
        self.cell_metrics: dict = {}

    @classmethod
    def server_max_batch(cls, concurrency: int, default: int) -> int | None:
        """Blocks per target pass the cloud may batch during a run at ``concurrency``
        (``default``: the server's configured value). None leaves it unchanged."""
        return None

    def _client(self, drafter, scheduler=None, **extra):
        from edge_sdk.client import EdgeClient

        c = self.ctx
        kw = {"depth": c.depth, **self.client_kw, **extra, **c.options.get("client", {})}
        return EdgeClient(c.base_url, drafter, c.tokenizer, signer=c.signer, chat=False,
                          transport=TaggingTransport(c.base_url, signer=c.signer),
                          scheduler=scheduler, **kw)

    async def _make_lanes(self) -> list[_Lane]:
        raise NotImplementedError

    async def open(self) -> None:
        from bench.pipeline import BusyExecutor

        self.worker = BusyExecutor()
        self.lanes = await self._make_lanes()

    async def close(self) -> None:
        for lane in self.lanes:
            if lane.own:
                await lane.client.close()
        if self.worker is not None:
            self.worker.shutdown(wait=True)

    async def run_request(self, req: BenchRequest) -> RequestRecord:
        return await self._run_on(self.lanes[0], req)

    async def _run_on(self, lane: _Lane, req: BenchRequest) -> RequestRecord:
        c = self.ctx
        calls: list[HttpCall] = []
        token = _REQUEST_CALLS.set(calls)
        try:
            t0 = time.perf_counter()
            trace: list[dict] = []
            res = await lane.client.generate(prompt_ids=list(req.prompt_ids),
                                             sampling=c.sampling, on_round=trace.append,
                                             max_new_tokens=c.max_new_tokens, seed=req.seed)
            t1 = time.perf_counter()
        finally:
            _REQUEST_CALLS.reset(token)
        m = dict(res.metrics, round_trace=trace)
        m.update(start_s=t0, end_s=t1, http_exchanges=len(calls),
                 prompt_tokens=len(req.prompt_ids))
        return RequestRecord(req, m, list(res.token_ids), res.text, res.finish_reason)

    async def run(self, reqs: Sequence[BenchRequest],
                  on_done: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
        """Run ``reqs`` with at most C in flight; records in request order."""
        c = self.ctx
        out: list[RequestRecord | None] = [None] * len(reqs)
        todo = iter(enumerate(reqs))
        busy0, cpu0 = self.worker.busy_s, time.process_time()
        link0 = c.link_bytes() if c.link_bytes else None

        async def lane_loop(lane: _Lane) -> None:
            for i, r in todo:          # one event loop: lanes share the iterator safely
                out[i] = rec = await self._run_on(lane, r)
                if on_done:
                    on_done(rec)

        tasks = [asyncio.ensure_future(lane_loop(lane)) for lane in self.lanes]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        recs = [r for r in out if r is not None]
        self.cell_metrics = {"edge_busy_s": self.worker.busy_s - busy0,
                             "edge_cpu_s": time.process_time() - cpu0}
        # link bytes: the emulator counts the whole run; each request gets the share of
        # the run's link bytes its message bodies carried (for its latency breakdown)
        body_up = sum(r.metrics["uplink_bytes"] for r in recs) or 1
        body_down = sum(r.metrics["downlink_bytes"] for r in recs) or 1
        if link0 is not None:
            up1, down1 = c.link_bytes()
            link_up, link_down = up1 - link0[0], down1 - link0[1]
            self.cell_metrics["link_delta"] = (link_up, link_down)
        for r in recs:
            m = r.metrics
            if link0 is not None:
                up = round(link_up * m["uplink_bytes"] / body_up)
                down = round(link_down * m["downlink_bytes"] / body_down)
            else:
                up, down = m["uplink_bytes"], m["downlink_bytes"]
            m.update(link_uplink_bytes=up, link_downlink_bytes=down,
                     breakdown_s=breakdown(m["wall_s"], m["draft_seconds"],
                                           m["target_seconds"], m["http_exchanges"], up, down,
                                           c.profile))
        return recs


@register_mode
class PipelineMode(ConcurrentMode):
    """AsymSpec's confirmed-prefix pipeline (AsymSpec §IV-C): C concurrent requests through ONE
    :class:`edge_sdk.EdgeClient` — its :class:`~edge_sdk.scheduler.DraftScheduler`
    grants the single draft worker to *ready* requests (confirmed prefix, no open block;
    at most one open block per request, never a descendant of an unresolved block), so
    while one request's block waits for verification another drafts. Compact asym
    protocol, fixed depth. The cloud re-batches whatever blocks have arrived: max batch
    >= C. ``ctx.options["policy"]``: scheduler policy (``fifo`` / ``fewest-tokens``)."""

    name = "pipeline"
    description = ("confirmed-prefix pipeline: C requests on one client/scheduler, "
                   "cloud re-batching (max batch >= C)")
    baseline = False
    client_mode: ClassVar[str] = "asym"

    @classmethod
    def server_max_batch(cls, concurrency: int, default: int) -> int:
        return max(int(concurrency), 1)

    async def _make_lanes(self) -> list[_Lane]:
        from edge_sdk.scheduler import DraftScheduler

        sched = DraftScheduler(self.ctx.options.get("policy", "fifo"))
        sched.executor.shutdown(wait=False)
        sched.executor = self.worker            # the run's one (timed) draft worker
        client = self._client(self.ctx.drafter, sched, mode=self.client_mode)
        return [_Lane(client)] + [_Lane(client, own=False)
                                  for _ in range(self.concurrency - 1)]


class _IndependentMode(ConcurrentMode):
    """C independent stop-and-wait requests: each lane its own client, scheduler and
    drafter fork (shared weights, own KV cache), but every draft forward runs on the
    run's ONE draft worker (the edge has one core), first come first served. Nothing
    coordinates the requests: there is no ready-request scheduling across them, and the
    cloud's cross-request batching is set by :attr:`max_batch` (``"C"``: max batch = C;
    an int: that value)."""

    client_mode: ClassVar[str] = "asym"
    max_batch: ClassVar[object] = 1

    @classmethod
    def server_max_batch(cls, concurrency: int, default: int) -> int:
        return max(int(concurrency), 1) if cls.max_batch == "C" else int(cls.max_batch)

    async def _make_lanes(self) -> list[_Lane]:
        from edge_sdk.scheduler import DraftScheduler

        lanes = []
        for i in range(self.concurrency):
            sched = DraftScheduler()
            sched.executor.shutdown(wait=False)
            sched.executor = self.worker
            d = self.ctx.drafter if i == 0 else self.ctx.drafter.fork()
            lanes.append(_Lane(self._client(d, sched, mode=self.client_mode)))
        return lanes


@register_mode
class NoPipelineMode(_IndependentMode):
    """Baseline without the confirmed-prefix pipeline (AsymSpec's "No pipeline"
    ablation): C requests, each stop-and-wait on its own client, compact asym protocol,
    fixed depth; the edge's draft compute is serialised on one shared worker (a request
    drafts whenever the worker is free, so one request may still draft while another's
    block is in flight — what is removed is the coordinated pipeline); the cloud verifies
    each block on its own (server max batch 1: no cross-request re-batching)."""

    name = "no-pipeline"
    description = ("baseline: C independent stop-and-wait requests, one shared draft "
                   "worker, no cloud batching (max batch 1)")
    baseline = True
    max_batch = 1


@register_mode
class RunaheadMode(_IndependentMode):
    """Same-request runahead baseline (AsymSpec's "No pipeline + runahead"): as
    ``no-pipeline`` (independent clients, one shared draft worker, max batch 1), and
    while a request's block is in flight it drafts its next block from the *assumed*
    prefix (block fully accepted + the draft's guess of the bonus token) — the client's
    ``proactive="npdg"`` (run to the planned depth, kept on a hit, discarded on a miss).
    Discarded tokens: ``runahead_wasted_tokens`` (and ``proactive_hit_rate``)."""

    name = "runahead"
    description = ("baseline: no-pipeline + same-request runahead (NPDG from the assumed "
                   "prefix; misses counted as wasted)")
    baseline = True
    max_batch = 1
    client_kw = {"proactive": "npdg"}


@register_mode
class StandardSDConcurrentMode(_IndependentMode):
    """``standard-sd`` at concurrency C: canonical edge-cloud speculative decoding for C
    users — C independent stop-and-wait requests with the standard protocol (full draft
    distribution q uploaded per position, cloud draws the corrections), one shared draft
    worker, each block verified on its own (max batch 1: cross-request re-batching is
    the pipeline's mechanism, AsymSpec §IV-C2; see ``pipeline-standard`` for the
    pipeline with this protocol)."""

    name = "standard-sd-concurrent"
    description = ("baseline: standard-sd with C concurrent requests (full q uplink, "
                   "one shared draft worker, no cloud batching)")
    baseline = True
    client_mode = "standard"
    max_batch = 1


@register_mode
class PipelineStandardMode(PipelineMode):
    """Ablation: the confirmed-prefix pipeline (one client/scheduler, cloud re-batching,
    max batch >= C) with the *standard* protocol (full q per draft position on the
    uplink, cloud-drawn corrections) instead of the compact asymmetric one — what the
    pipeline gains without AsymSpec's protocol (AsymSpec Table II, "No asymmetric
    correction"). Not a baseline: it uses the pipeline's own mechanisms."""

    name = "pipeline-standard"
    description = ("ablation: the pipeline with the standard full-q protocol (cloud "
                   "re-batching, max batch >= C)")
    baseline = False
    client_mode = "standard"
