"""One verifier replica: a :class:`cloud_api.service.CloudService` in a Ray actor.

The replica owns its sessions' KV caches and batches its own blocks (AsymSpec §IV-C,
one queue per replica). Its methods mirror the service's route-facing calls; each
answers a tagged pair so that an :class:`cloud_api.sessions.ApiError` crosses the
process boundary as data, not as a Ray exception: ``("ok", value)`` or
``("err", (status, code, message, field, extra))`` (:func:`unwrap` re-raises it).

Session ids name their replica: ``sid = random32 * SLOTS + slot`` (:func:`slot_of`),
so every ingress worker routes a session to the replica that created it without a
shared table.
"""

from __future__ import annotations

import functools
import hashlib
import json
import secrets

from cloud_api.sessions import ApiError
from edge_sdk.protocol import wire

__all__ = ["SLOTS", "VerifierReplica", "load_target", "model_identity", "slot_of",
           "unwrap"]

SLOTS = 256
"""Most replicas one deployment addresses (the slot is the id modulo SLOTS)."""


def slot_of(sid_text: str) -> int | None:
    """The replica slot a session id names; None for a text that is not an id."""
    try:
        sid = int(sid_text)
    except (TypeError, ValueError):
        return None
    return sid % SLOTS if sid > 0 else None


def load_target(target, dtype: str = "float32", threads: int | None = None):
    """``(model, tokenizer)`` of ``target``: a model spec (preset, HF path, .gguf; see
    :func:`edge_sdk.models.load_model`) or a picklable zero-argument factory returning
    the pair (tests pass a tiny model's). Raises what ``load_model`` raises."""
    if callable(target):
        return target()
    from edge_sdk.models import load_model

    return load_model(target, dtype=dtype, threads=threads)


def target_name(target) -> str:
    """What an operator calls ``target``: the model spec, or a factory's qualified name."""
    if isinstance(target, str):
        return target
    fn = getattr(target, "func", target)            # functools.partial
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


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
    """``model`` (its name, for messages), ``config_sha`` and ``weights_sha`` of a loaded
    target: replicas that agree on the last two serve the same model."""
    return {"model": target_name(target), "config_sha": config_sha(model),
            "weights_sha": weights_sha(model)}


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
    """One replica (wrapped by ``ray.remote`` in :mod:`cloud_api.replicas.cluster`).

    Args:
        target: model spec or factory (:func:`load_target`), loaded in the replica.
        slot: this replica's index in ``[0, SLOTS)``; its session ids carry it.
        dtype, threads: the target's dtype and torch threads (seconds of target time
            per pass depend on them).
        service_kw: :class:`cloud_api.service.CloudService` options (max_batch,
            max_wait_s, session_ttl_s, max_sessions, kv_budget_bytes, ...).
    Raises:
        ValueError: ``slot`` outside ``[0, SLOTS)``.
    """

    def __init__(self, target, slot: int, dtype: str = "float32",
                 threads: int | None = 1, **service_kw):
        if not 0 <= slot < SLOTS:
            raise ValueError(f"slot must be in [0, {SLOTS})")
        from cloud_api.service import CloudService

        model, tok = load_target(target, dtype, threads)
        self.slot = slot
        self.identity = {**model_identity(target, model), "dtype": dtype}
        self.svc = CloudService(model, tok, threads=threads, **service_kw)
        self.svc.sessions.new_id = self._new_id
        self._running = False

    def _new_id(self) -> int:
        """A fresh session id naming this replica's slot (never 0)."""
        while True:
            sid = (secrets.randbits(32) or 1) * SLOTS + self.slot
            if sid not in self.svc.sessions._s:
                return sid

    async def _started(self) -> None:
        if not self._running:      # the queue's task lives on the actor's event loop
            self._running = True
            await self.svc.start()

    @_tagged
    async def info(self) -> dict:
        """What the ingress needs to decode requests and answer /healthz, and the
        identity of the model (:func:`model_identity`, and the dtype asked for) it
        checks replicas against."""
        v = self.svc.verifier
        return {"slot": self.slot, "vocab_size": v.vocab_size, "max_block": v.max_block,
                "tokenizer_hash": self.svc.fingerprint, **self.identity}

    @_tagged
    async def stats(self) -> dict:
        """:meth:`cloud_api.service.CloudService.stats` plus the slot."""
        self.svc.sessions.expire()
        return {"slot": self.slot, **self.svc.stats()}

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
        return await self.svc.correction(sid, body, owner)

    @_tagged
    async def state(self, sid: str, owner: str | None) -> dict:
        return await self.svc.state(sid, owner)

    @_tagged
    async def remove(self, sid: str, owner: str | None) -> None:
        await self.svc.remove(sid, owner)

    async def pid(self) -> int:
        """The replica's process id (tests, operators)."""
        import os

        return os.getpid()
