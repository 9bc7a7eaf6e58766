"""One verifier replica: a :class:`cloud_api.service.CloudService` in a Ray Serve replica.

The replica owns its sessions' KV caches and batches its own blocks (AsymSpec §IV-C,
one queue per replica). :class:`VerifierReplica` is the body of the ``verifier``
deployment (:func:`cloud_api.replicas.cluster.start_replicas`); its methods mirror the
service's route-facing calls and each answers a tagged pair, so that an
:class:`cloud_api.sessions.ApiError` crosses the process boundary as data, not as a
Ray exception: ``("ok", value)`` or ``("err", (status, code, message, field, extra))``
(:func:`unwrap` re-raises it).

Session ids name their replica: ``sid = (random32 * 256 + generation) * 256 + slot``
(:func:`placement_of`). At start-up a replica takes a free ``slot`` and that slot's next
``generation`` (1..255) from the deployment's
:class:`~cloud_api.replicas.registry.ReplicaRegistry` and publishes both as its Serve
replica metadata; the :class:`~cloud_api.replicas.router.SessionRouter` of every
ingress reads them there. A replica Serve restarts in place of a dead one may get the
dead one's slot, never its generation: a session id of another slot or generation is
not this replica's, and is answered 404 ``session_evicted`` (the edge SDK re-creates
the session from its confirmed prefix).
"""

from __future__ import annotations

import functools
import hashlib
import json
import secrets
import time

from cloud_api.sessions import ApiError
from edge_sdk.protocol import wire

__all__ = ["SLOTS", "VerifierReplica", "load_target", "model_identity", "placement_of",
           "slot_of", "spec_sha", "unwrap"]

SLOTS = 256
"""Most replicas one deployment addresses (the slot is the id modulo SLOTS)."""

GENERATIONS = 256
"""Generations per slot are 1..GENERATIONS-1 (0: never issued), cycling."""

STATS_REFRESH_S = 10.0
"""Seconds the routing stats stay the same while the session count does (each change
is a broadcast from the Serve controller to every handle)."""


def placement_of(sid_text) -> tuple[int, int] | None:
    """``(slot, generation)`` a session id names; None for a text that is not an id of
    ours (not a positive integer, or generation 0)."""
    try:
        sid = int(sid_text)
    except (TypeError, ValueError):
        return None
    slot, gen = sid % SLOTS, (sid // SLOTS) % GENERATIONS
    return (slot, gen) if sid > 0 and gen else None


def slot_of(sid_text) -> int | None:
    """The replica slot a session id names; None for a text that is not an id."""
    where = placement_of(sid_text)
    return None if where is None else where[0]


def load_target(target, dtype: str = "float32", threads: int | None = None):
    """``(model, tokenizer)`` of ``target``: a model spec (preset, HF path, .gguf; see
    :func:`edge_sdk.models.load_model`) or a picklable zero-argument factory returning
    the pair (tests pass a tiny model's). Raises what ``load_model`` raises."""
    if callable(target):
        return target()
    from edge_sdk.models import load_model

    from edge_sdk.packed import packed_default
    return load_model(target, dtype=dtype, threads=threads, packed=packed_default())


def target_name(target) -> str:
    """What an operator calls ``target``: the model spec, or a factory's qualified name."""
    if isinstance(target, str):
        return target
    fn = getattr(target, "func", target)            # functools.partial
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def spec_sha(target) -> str:
    """SHA-256 (16 hex chars) of what the ingress asks the replicas to load: the spec
    text, or a factory's pickled bytes (its arguments included): an existing deployment
    is reused only when it was started with the same one."""
    if isinstance(target, str):
        raw = target.encode()
    else:
        from ray import cloudpickle

        raw = cloudpickle.dumps(target)
    return hashlib.sha256(raw).hexdigest()[:16]


def config_sha(model) -> str:
    """SHA-256 (16 hex chars) of the model's architecture config, less its path, dtype
    and library version (which differ between equal models)."""
    cfg = {k: v for k, v in model.config.to_dict().items()
           if not k.startswith("_") and k not in ("torch_dtype", "dtype",
                                                  "transformers_version")}
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()
                          ).hexdigest()[:16]


def weights_sha(model, samples: int = 64) -> str:
    """A cheap weights fingerprint (16 hex chars): every tensor's name, shape, dtype and
    ``samples`` values spread over it (about ``samples`` x tensors reads: milliseconds
    for a 1.5B model). Equal models agree; a different checkpoint, a fine-tune or other
    dtype disagrees (unless they match at every sampled value)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(flat[::step][:samples].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def model_identity(target, model) -> dict:
    """``model`` (its name, for messages), ``spec_sha``, ``config_sha`` and
    ``weights_sha`` of a loaded target: replicas that agree on the last two serve the
    same model."""
    return {"model": target_name(target), "spec_sha": spec_sha(target),
            "config_sha": config_sha(model), "weights_sha": weights_sha(model)}


def unwrap(reply):
    """The value of a replica's tagged answer. Raises ApiError for an ``err`` answer."""
    tag, value = reply
    if tag == "err":
        status, code, message, field, extra = value
        raise ApiError(status, code, message, field, **extra)
    return value


def _tagged(fn):
    """Run an async replica method; ApiError / WireError become ``("err", ...)``."""
    @functools.wraps(fn)
    async def run(self, *args):
        await self._started()
        try:
            return "ok", await fn(self, *args)
        except ApiError as e:
            return "err", (e.status, e.code, e.message, e.field, e.extra)
        except wire.WireError as e:
            return "err", (400, "bad_request", e.message, e.field, {})
    return run


class _NoBudget(Exception):
    """The block needs ``n`` tokens of a budget the ingress could not promise."""

    def __init__(self, n: int):
        super().__init__(n)
        self.n = n


class VerifierReplica:
    """One replica of the ``verifier`` Serve deployment.

    Args:
        target: model spec or factory (:func:`load_target`), loaded in the replica.
        registry: name of the deployment's :class:`~cloud_api.replicas.registry.
            ReplicaRegistry` actor (``specrelay`` namespace), which hands out the slot.
        dtype, threads: the target's dtype and torch threads (seconds of target time
            per pass depend on them).
        service_kw: :class:`cloud_api.service.CloudService` options (max_batch,
            max_wait_s, session_ttl_s, max_sessions, kv_budget_bytes, ...).
    Raises:
        RuntimeError: every slot is held by a live replica (the registry's refusal).
    """

    def __init__(self, target, registry: str, dtype: str = "float32",
                 threads: int | None = 1, **service_kw):
        from cloud_api.replicas.registry import register
        from cloud_api.service import CloudService

        model, tok = load_target(target, dtype, threads)
        self.identity = {**model_identity(target, model), "dtype": dtype}
        self.svc = CloudService(model, tok, threads=threads, **service_kw)
        self.svc.sessions.new_id = self._new_id
        self._running = False
        self._routing: dict = {}
        self.slot, self.generation, self.name = register(registry)

    # -- Serve hooks ----------------------------------------------------------------
    async def record_replica_metadata(self) -> dict:
        """Serve hook (once, when the replica is ready): the ``slot`` and
        ``generation`` every :class:`~cloud_api.replicas.router.SessionRouter` routes
        this replica's sessions by."""
        return {"slot": self.slot, "generation": self.generation}

    async def record_routing_stats(self) -> dict:
        """Serve hook (every ``request_routing_stats_period_s``): open ``sessions`` and
        the wall-clock second ``at`` they were counted (the router adds the creates it
        placed here since). Unchanged while the count is, for up to STATS_REFRESH_S."""
        self.svc.sessions.expire()
        n, now = len(self.svc.sessions), time.time()
        if self._routing.get("sessions") != n or now - self._routing["at"] > STATS_REFRESH_S:
            self._routing = {"sessions": n, "at": now}
        return self._routing

    # -- ids ------------------------------------------------------------------------
    def _new_id(self) -> int:
        """A fresh session id naming this replica's slot and generation (never 0)."""
        while True:
            sid = ((secrets.randbits(32) or 1) * GENERATIONS + self.generation) * SLOTS \
                + self.slot
            if sid not in self.svc.sessions._s:
                return sid

    def _own(self, sid: str) -> None:
        """Raises ApiError 404: ``session_not_found`` for a text that is no session id,
        ``session_evicted`` for the id of another slot or generation (its replica is
        gone: the router sends such ids to any live replica)."""
        where = placement_of(sid)
        if where is None:
            raise ApiError(404, "session_not_found", "unknown or expired session",
                           "session_id")
        if where != (self.slot, self.generation):
            raise ApiError(404, "session_evicted", "the verifier replica holding this "
                           "session is gone: re-create it from the confirmed prefix",
                           "session_id")

    def _addressed(self, slot: int) -> None:
        """Raises ApiError 503 ``replica_unavailable`` when a call meant for ``slot``
        reached this replica (that slot's replica is gone or not routable yet)."""
        if slot != self.slot:
            raise ApiError(503, "replica_unavailable", f"verifier replica {slot} is not "
                           "available (restarting, or gone)", "slot")

    async def _started(self) -> None:
        if not self._running:      # the queue's task lives on the replica's user loop
            self._running = True
            await self.svc.start()

    # -- calls of the ingress ---------------------------------------------------------
    @_tagged
    async def info(self, slot: int) -> dict:
        """What the ingress needs to decode requests and answer /healthz, the identity
        of the model (:func:`model_identity`, and the dtype asked for) it checks
        replicas against, and the Serve actor name (``replica``). Raises ApiError 503
        when ``slot`` is not this replica's."""
        self._addressed(slot)
        v = self.svc.verifier
        return {"slot": self.slot, "generation": self.generation, "replica": self.name,
                "vocab_size": v.vocab_size, "max_block": v.max_block,
                "tokenizer_hash": self.svc.fingerprint, **self.identity}

    @_tagged
    async def stats(self, slot: int) -> dict:
        """:meth:`cloud_api.service.CloudService.stats` plus slot, generation and the
        Serve actor name. Raises ApiError 503 when ``slot`` is not this replica's."""
        self._addressed(slot)
        self.svc.sessions.expire()
        return {"slot": self.slot, "generation": self.generation, "replica": self.name,
                **self.svc.stats()}

    @_tagged
    async def create(self, body: dict, owner: str | None) -> dict:
        return await self.svc.create(body, owner)

    @_tagged
    async def verify(self, sid: str, body: bytes, owner: str | None,
                     may_charge: bool) -> tuple[bytes | None, int]:
        """``(answer, tokens to charge)``; ``(None, n)`` when the block needs ``n``
        tokens and ``may_charge`` is False (the ingress could not promise them: it
        charges, which refuses with 429/403, or retries). A duplicate is answered
        from the replay cache with 0 to charge, as on one server."""
        self._own(sid)
        need: list[int] = []

        def charge(n: int) -> None:
            if not may_charge:
                raise _NoBudget(n)
            need.append(n)

        try:
            out = await self.svc.verify(sid, body, owner, charge)
        except _NoBudget as e:
            return None, e.n
        return out, sum(need)

    @_tagged
    async def correction(self, sid: str, body: bytes, owner: str | None) -> bytes:
        self._own(sid)
        return await self.svc.correction(sid, body, owner)

    @_tagged
    async def state(self, sid: str, owner: str | None) -> dict:
        self._own(sid)
        return await self.svc.state(sid, owner)

    @_tagged
    async def remove(self, sid: str, owner: str | None) -> None:
        self._own(sid)
        await self.svc.remove(sid, owner)
