"""The verification service behind the API: the target model, its sessions (one KV cache
each) and the batched verification queue (AsymSpec §IV-B). HTTP-free: the route
handlers (:mod:`cloud_api.routes`) decode requests and call it."""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch

from cloud_api.batcher import VerifyQueue
from cloud_api.sessions import ApiError, Session, SessionStore
from cloud_api.verifier import Verifier
from edge_sdk.kvmodel import KVModel
from edge_sdk.models import encode_prompt, eos_ids, tokenizer_fingerprint
from edge_sdk.protocol import wire
from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS

__all__ = ["CloudService", "kv_bytes_per_token"]


def kv_bytes_per_token(model) -> int:
    """KV-cache bytes one token costs: layers x 2 (K, V) x kv_heads x head_dim x dtype."""
    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * heads * head_dim * next(model.parameters()).element_size()


class CloudService:
    """Owns the target model, the sessions and the verification queue.

    ``verifier``: a :class:`cloud_api.scoring.interface.VerifierBackend` other than the
    torch verifier of ``model`` (e.g. :class:`cloud_api.scoring.verifier.
    ScoringVerifier`; ``model`` may then be None: no KV cache of ours).
    ``semantic``: a :class:`cloud_api.wisv.serving.SemanticAcceptance` (WISV's
    decision head, threshold policy and per-block cap) for sessions that ask for
    ``acceptance="semantic"``; None refuses them (422 ``semantic_unavailable``).
    ``free_rows``: token rows a target pass holds at about the cost of one, advertised
    to clients for sizing their sibling trees (None: the torch verifier's engine rule,
    :func:`edge_sdk.models.free_pass_rows`). ``row_invariant``: the torch verifier's
    row invariance (``exact`` / ``fast`` / ``off``; None: ``$SPECRELAY_ROW_INVARIANT`` or
    ``exact``; :class:`cloud_api.verifier.Verifier`)."""

    def __init__(self, model, tokenizer, *, max_block: int = MAX_DRAFT_TOKENS, max_batch: int = 8,
                 max_wait_s: float = 0.0, session_ttl_s: float = 600.0,
                 max_sessions: int = 256, max_sessions_per_key: int = 64,
                 kv_budget_bytes: int | None = None, threads: int | None = None,
                 metrics=None, early_head=None, verifier=None, semantic=None,
                 free_rows: int | None = None, row_invariant: str | None = None):
        self.model, self.tokenizer = model, tokenizer
        if verifier is not None and semantic is not None:
            raise ValueError("semantic acceptance needs the torch verifier (hidden states)")
        if semantic is not None:                 # the token guard reads the tokenizer
            semantic.bind(tokenizer, int(model.config.vocab_size))
        self.verifier = verifier or Verifier(model, max_block, early_head, semantic,
                                             free_rows=free_rows,
                                             row_invariant=row_invariant)
        if metrics is not None:
            self.verifier.on_early_outcome = (
                lambda hit: metrics.early_verdicts.labels("hit" if hit else "miss").inc())
        self.sessions = SessionStore(session_ttl_s, max_sessions, max_sessions_per_key,
                                     kv_budget_bytes,
                                     kv_bytes_per_token(model) if model is not None else 0)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="target")
        self.queue = VerifyQueue(self.verifier, self.executor, max_batch, max_wait_s,
                                 metrics.observe_batch if metrics else None)
        self.eos = eos_ids(model, tokenizer)
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.threads = threads
        self.metrics = metrics
        self._locks: dict[int, asyncio.Lock] = {}
        self._creates: OrderedDict = OrderedDict()   # (owner, request_id) -> (digest, fut)

    async def start(self, app=None) -> None:
        if self.threads:
            await asyncio.get_running_loop().run_in_executor(
                self.executor, torch.set_num_threads, self.threads)
        self.queue.start()

    async def stop(self, app=None) -> None:
        await self.queue.stop()
        self.executor.shutdown(wait=True)

    def lock(self, sid: int) -> asyncio.Lock:
        return self._locks.setdefault(sid, asyncio.Lock())

    CREATES_REMEMBERED = 4096   # request ids of recent creates, for retried creates

    async def create(self, body: dict, owner: str | None) -> dict:
        """Create a session. A create carrying the ``request_id`` of an earlier one of
        the same key (a retry: the answer was lost or late) gets that session's answer,
        awaiting it while it is still being made, instead of a second session; the same
        id with a different body is refused (409 ``request_id_reused``). Raises
        ApiError / WireError."""
        m = wire.decode_session_request(body, self.verifier.vocab_size,
                                        self.verifier.max_context)
        if m["request_id"] is None:
            return await self._create(m, owner)
        key, digest = (owner, m["request_id"]), hashlib.sha256(repr(body).encode()).digest()
        seen = self._creates.get(key)
        if seen is not None:
            if seen[0] != digest:
                raise ApiError(409, "request_id_reused", "request_id already used for "
                               "another session", "request_id")
            return await asyncio.shield(seen[1])
        fut = asyncio.get_running_loop().create_future()
        self._creates[key] = (digest, fut)
        while len(self._creates) > self.CREATES_REMEMBERED:
            self._creates.popitem(last=False)
        try:
            out = await self._create(m, owner)
        except BaseException as e:
            self._forget_failed(key, fut, e)
            raise
        fut.set_result(out)
        return out

    def _forget_failed(self, key, fut: asyncio.Future, err: BaseException) -> None:
        """A create that failed is not remembered (its retry runs again); a retry
        waiting for it gets the same error."""
        if key in self._creates and self._creates[key][1] is fut:
            del self._creates[key]
        if isinstance(err, Exception):
            fut.set_exception(err)
            fut.exception()                  # retrieved: no warning without a waiter
        else:
            fut.cancel()

    async def _create(self, m: dict, owner: str | None) -> dict:
        """Create a session from a decoded create request ``m``."""
        V = self.verifier.vocab_size
        if m["vocab_size"] is not None and m["vocab_size"] != V:
            raise ApiError(422, "vocab_mismatch", f"draft vocabulary {m['vocab_size']} does "
                           f"not match the target's {V}: draft and target must share a "
                           "tokenizer", "vocab_size")
        fp = m["tokenizer_hash"]
        if fp is not None and fp != self.fingerprint:
            raise ApiError(422, "tokenizer_mismatch", "the draft's tokenizer differs from "
                           "the target's: draft and target must share a tokenizer",
                           "tokenizer_hash")
        self.verifier.check_acceptance(m["acceptance"], m["sampling"])
        ids = m.get("prompt_ids") or encode_prompt(self.tokenizer, m["prompt"], m["chat"])
        if len(ids) >= self.verifier.max_context:
            raise ApiError(422, "context_full", "prompt exceeds the model context", "prompt")
        self.sessions.check_owner_limit(owner)   # before spending a prefill
        s = Session(self.sessions.new_id(), owner, m["sampling"], m["seed"], m["mode"],
                    m["support_k"], m["n_proposals"], m["max_new_tokens"],
                    KVModel(self.model) if self.model is not None else None,
                    list(ids), len(ids), acceptance=m["acceptance"])
        loop = asyncio.get_running_loop()
        prefill_s = await loop.run_in_executor(self.executor, self.verifier.open, s)
        self.sessions.add(s)
        if self.metrics is not None:
            self.metrics.sessions.set(len(self.sessions))
            self.metrics.evictions.set(self.sessions.evictions)
        # the prompt's ids go back only to a client that sent text (it needs the
        # tokenisation); one that sent ids has them: echoing them was most of a short
        # request's downlink (~3-5 bytes per prompt token)
        echo = {} if m.get("prompt_ids") else {"prompt_ids": ids}
        return {**s.state(), **echo, "vocab_size": V,
                "max_block": self.verifier.max_block, "eos_token_ids": self.eos,
                **self.tree_limits(),
                "prefill_s": prefill_s}

    def tree_limits(self) -> dict:
        """What a session create advertises about token trees: ``max_tree_rows`` (the
        most rows a tree may have) and ``free_rows`` (the rows a pass holds at about
        the cost of one); both 0 on a verifier without trees."""
        v = self.verifier
        if not getattr(v, "supports_trees", False):
            return {"max_tree_rows": 0, "free_rows": 0}
        return {"max_tree_rows": v.max_tree_rows, "free_rows": v.free_rows}

    async def verify(self, sid: str, body: bytes, owner: str | None, charge=None,
                     on_early=None) -> bytes:
        """Verify one block. ``charge(n)`` meters the block's n = g + 1 tokens before the
        target pass (it raises to refuse; a duplicate is answered without charge).
        ``on_early(bytes)``: called on the event loop with the encoded EarlyVerdict of
        the block while its pass still runs (FSD; only with an early exit, never for a
        duplicate answered from the replay cache)."""
        s = self.sessions.get(sid, owner)
        async with self.lock(s.id):
            digest = hashlib.sha256(body).digest()
            req = wire.VerifyRequest.decode(body, self.verifier.vocab_size,
                                            self.verifier.max_block)
            seen = s.replay.get(req.block_seq)
            if seen is not None:
                if seen[0] == digest:     # a retry: same decisions, same draws
                    return seen[1]
                raise ApiError(409, "block_seq_reused",
                               "block_seq already answered with different content",
                               "block_seq", state=s.state())
            self.verifier.check(s, req)   # stale blocks are refused before any charge
            if charge is not None:
                charge(len(req.tokens) + 1)
            resp = await self.queue.submit(s, req, self._early_sink(on_early))
            self.sessions.enforce(keep=s.id)   # the block grew the KV cache
            out = resp.encode()
            if self.metrics is not None:
                self.metrics.observe_verify(resp, len(req.tokens))
            s.remember(req.block_seq, digest, out, req.pending_commit is not None)
            return out

    def _early_sink(self, on_early):
        """A target-thread callable handing an EarlyVerdict's bytes to ``on_early`` on
        the event loop (None without an early exit or a caller that wants it)."""
        if on_early is None or self.verifier.early_head is None:
            return None
        loop = asyncio.get_running_loop()
        return lambda v: loop.call_soon_threadsafe(on_early, v.encode())

    async def correction(self, sid: str, body: bytes, owner: str | None) -> bytes:
        s = self.sessions.get(sid, owner)
        async with self.lock(s.id):
            req = wire.CorrectionRequest.decode(body, self.verifier.vocab_size)
            out = self.verifier.correction(s, req).encode()
            if self.metrics is not None:
                self.metrics.corrections.labels(
                    "full_fetch" if req.k is None else "support_fetch").inc()
            return out

    def delete(self, sid: str, owner: str | None) -> None:
        """Remove a session. Raises ApiError 404 (unknown, evicted or foreign)."""
        s = self.sessions.get(sid, owner)
        self.sessions.remove(s.id)
        self._locks.pop(s.id, None)
        self.verifier.close(s)

    # the route-facing calls that a replicated service answers remotely
    # (:class:`cloud_api.replicas.ingress.RoutedService` has the same ones)

    async def state(self, sid: str, owner: str | None) -> dict:
        """The confirmed state of a session (JSON map). Raises ApiError 404."""
        return self.sessions.get(sid, owner).state()

    async def remove(self, sid: str, owner: str | None) -> None:
        """:meth:`delete`, awaitable. Raises ApiError 404."""
        self.delete(sid, owner)

    async def health(self) -> dict:
        """``GET /healthz``'s map: open sessions, vocabulary size, tokenizer hash, the
        target's context (tokens; a longer prompt is refused)."""
        return {"status": "ok", "sessions": len(self.sessions),
                "vocab_size": self.verifier.vocab_size, "tokenizer_hash": self.fingerprint,
                "max_context": self.verifier.max_context}

    def stats(self) -> dict:
        """Load figures: open sessions, KV-cache bytes they hold, target passes and
        seconds (the replica router's least-loaded choice reads ``sessions``)."""
        return {"sessions": len(self.sessions), "kv_bytes": self.sessions.kv_bytes(),
                "passes": self.verifier.passes, "target_s": self.verifier.target_seconds,
                "semantic_accepted_tokens": getattr(self.verifier, "semantic_accepted", 0)}
