"""The edge's handle on one verification session of the cloud: create, verify,
correction, delete, and blocks sent ahead (the wire side of one request).

Header state: ``seq`` is the block sequence number of the next block and ``pending``
the correction token the edge owes the cloud (drawn on the edge after a rejection,
sent with the next block). A round that fails to complete restores both
(:meth:`RemoteSession.header` / :meth:`RemoteSession.restore`): a resent block is
answered from the cloud's replay cache. A session the cloud evicted (404) is
re-created from the confirmed prefix and the block resent.

A semantic session (WISV) sends its channel state with every block; the state is taken
once per block sequence number, so a block re-encoded after a failed round is the same
bytes (answered from the cloud's replay cache, never decided again).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

import numpy as np
import torch

from edge_sdk.drafters.base import DraftBlock
from edge_sdk.metrics import RequestMetrics
from edge_sdk.protocol import frames, wire
from edge_sdk.protocol.limits import CREATE_TIMEOUT_S_PER_TOKEN, MAX_DRAFT_TOKENS
from edge_sdk.protocol.sampling import SamplingConfig
from edge_sdk.transport import MSGPACK, UNREACHABLE, RemoteError, Transport


def new_request_id() -> str:
    """A fresh idempotency key for one session create (16 URL-safe characters)."""
    return secrets.token_urlsafe(12)


def create_timeout_s(transport, n_prompt: int) -> float | None:
    """Seconds a session create on an ``n_prompt``-token prompt waits for each answer:
    ``transport``'s per-request timeout plus :data:`CREATE_TIMEOUT_S_PER_TOKEN` a token
    (the cloud prefills the prompt before answering). None for a transport without a
    ``timeout_s`` (in-process and emulated links: their own timing) or whose
    ``request`` takes no ``timeout_s`` (a subclass written before it)."""
    base = getattr(transport, "timeout_s", None)
    if base is None or not _takes(transport.request, "timeout_s"):
        return None
    return base + n_prompt * CREATE_TIMEOUT_S_PER_TOKEN


def _takes(fn, name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name``."""
    import inspect

    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


@dataclass(frozen=True)
class SessionParams:
    """What session create sends besides the prompt (fixed for one request).

    mode: ``asym`` or ``standard``; support_k, n_proposals: correction stage sizes;
    draft_vocab: the drafter's vocabulary size (None: no drafter); vocab: the edge's
    vocabulary size (the drafter's, else the tokenizer's; bounds ``support_k``).
    acceptance: ``exact`` (default; the create body does not mention it) or
    ``semantic`` (WISV, lossy).
    """

    cfg: SamplingConfig
    seed: int
    mode: str
    support_k: int
    n_proposals: int
    tokenizer_hash: str
    draft_vocab: int | None
    vocab: int
    acceptance: str = "exact"

    def body(self, prompt_ids: list[int], max_new: int, packed: bool = True) -> dict:
        """The create request's map (``POST /v1/sessions``). ``packed``: the prompt as
        ``prompt_packed`` (:func:`wire.pack_prompt`; ~0.6x the bytes on Qwen2.5's
        vocabulary) where that encodes shorter than the ``prompt_ids`` array. Fields
        equal to their wire defaults (:data:`wire.SESSION_DEFAULTS`, the default
        sampling values) are left out: on a 32-token request the create is most of the
        uplink."""
        dflt, greedy = wire.SESSION_DEFAULTS, SamplingConfig().to_dict()
        sampling = {k: v for k, v in self.cfg.to_dict().items() if v != greedy[k]}
        body = {"prompt_ids": [int(t) for t in prompt_ids]}
        if packed:              # the shorter encoding (a short prompt of small ids is
            z = {"prompt_packed": wire.pack_prompt(body["prompt_ids"])}   # the array)
            if len(wire.pack(z)) < len(wire.pack(body)):
                body = z
        body.update({"sampling": sampling, "seed": self.seed, "max_new_tokens": max_new,
                     "tokenizer_hash": self.tokenizer_hash, "mode": self.mode,
                     "support_k": max(1, min(self.support_k, self.vocab)),    # K <= V
                     "n_proposals": self.n_proposals, "acceptance": self.acceptance})
        if not sampling:
            del body["sampling"]
        for k, v in dflt.items():
            if body.get(k) == v:
                del body[k]
        if self.draft_vocab is not None:
            body["vocab_size"] = self.draft_vocab
        return body


@dataclass
class Ahead:
    """A proactive block sent before its predecessor's verdict (``send_ahead``)."""

    future: asyncio.Future       # -> (VerifyResponse, perf_counter) | None
    block: DraftBlock
    plan: int
    body: bytes                  # the exact request bytes (a resend replays them)
    t_sent: float
    root: int                    # the assumed bonus of the predecessor


class RemoteSession:
    """One cloud session of a request. Counts message bytes in ``metrics``.
    ``channel``: ``() -> (rtt_s, uplink_bps, round_s)``, the link state a semantic
    session sends with each block (None: not sent)."""

    def __init__(self, transport: Transport, params: SessionParams, metrics: RequestMetrics,
                 channel=None):
        self.transport, self.params, self.m = transport, params, metrics
        self.channel = channel
        self._channels: dict[int, tuple] = {}    # block seq -> the state it carries
        self.sid: int | None = None
        self.vocab = 0                        # the target's vocabulary (from create)
        self.max_block = self._body_cap(MAX_DRAFT_TOKENS)   # until the cloud says its own
        self.seq, self.pending = 0, None
        self.path: str | None = None          # /v1/sessions/{sid} once created
        self.siblings = None                  # a SiblingPolicy (greedy sibling trees)
        self.max_tree_rows = 0                # the cloud's tree limit (0: no trees)
        self.free_rows = 0                    # rows a cloud pass holds for free

    def _body_cap(self, max_block: int) -> int:
        """``max_block`` capped, for a ``standard`` session, at the block whose full
        distributions fit one request body (:func:`wire.max_full_rows`)."""
        if self.params.mode != "standard" or not self.params.draft_vocab:
            return max_block
        return min(max_block, wire.max_full_rows(self.params.draft_vocab))

    async def call(self, method: str, path: str, body: bytes = b"", on_early=None,
                   timeout_s: float | None = None) -> bytes:
        kw = {} if on_early is None else {"on_early": on_early}    # FSD transports only
        if timeout_s is not None:
            kw["timeout_s"] = timeout_s
        data, _ = await self.transport.request(method, path, body, MSGPACK, **kw)
        self.m.uplink_bytes += len(body)
        self.m.downlink_bytes += len(data)
        return data

    async def create(self, prompt_ids: list[int], max_new: int,
                     request_id: str | None = None) -> dict:
        """Create (or re-create) the session on the confirmed prefix ``prompt_ids``;
        returns the cloud's answer (``eos_token_ids``, ``max_block``, ...). The body
        carries ``request_id`` (None: a fresh one): the transport's retries resend the
        same bytes, and a caller that retries the create itself (waiting out a lost
        cloud) passes the same id, so a create whose answer was lost or late gets the
        same session, not a second one and a second prefill of the prompt (a
        server that does not know ``request_id`` or ``prompt_packed`` is asked again
        without it). The create waits :func:`create_timeout_s` for its answer: the
        cloud prefills the prompt first."""
        packed, rid = True, {"request_id": request_id or new_request_id()}
        wait = create_timeout_s(self.transport, len(prompt_ids))
        while True:
            body = {**self.params.body(prompt_ids, max_new, packed), **rid}
            try:
                data = await self.call("POST", "/v1/sessions", wire.pack(body),
                                       timeout_s=wait)
                break
            except RemoteError as e:
                # a server older than the field: ask again in the form it knows
                if e.status not in (400, 422) or not (
                        (e.field == "prompt_packed" and packed)
                        or (e.field == "request_id" and rid)):
                    raise
                if e.field == "prompt_packed":
                    packed = False
                else:
                    rid = {}
        info = wire.unpack(data)
        self.sid, self.vocab = int(info["session_id"]), int(info["vocab_size"])
        self.max_block = self._body_cap(int(info.get("max_block", self.max_block)))
        self.max_tree_rows = int(info.get("max_tree_rows", 0))
        self.free_rows = int(info.get("free_rows", 0))
        self.seq, self.pending = 0, None
        self._channels.clear()
        self.path = f"/v1/sessions/{self.sid}"
        return info

    async def delete(self) -> None:
        await self.call("DELETE", self.path)

    def header(self) -> tuple[int, int | None]:
        return self.seq, self.pending

    def restore(self, header: tuple[int, int | None]) -> None:
        self.seq, self.pending = header

    def advance(self) -> None:
        """The block ``seq`` was answered: the next block is ``seq + 1``."""
        self.pending, self.seq = None, self.seq + 1

    # ------------------------------------------------------------------ verify

    def request(self, tokens: list[int], block: DraftBlock | None,
                ahead: bool = False) -> wire.VerifyRequest:
        """The verify request of ``block`` on the confirmed prefix ``tokens``: the next
        block (``seq``, ``pending``), or with ``ahead`` the one after it (no correction
        can be pending on an assumed full acceptance). ``expect_last`` is the last
        confirmed token whenever no correction is pending, so a block sent ahead and the
        same block sent after its predecessor's verdict are the same bytes (a resend is
        answered from the cloud's replay cache)."""
        seq, pending = (self.seq + 1, None) if ahead else (self.seq, self.pending)
        toks = np.array(block.tokens if block else [], dtype=np.int64)
        q_tok = q_full = None
        if block is not None and self.params.mode == "standard":
            q_full = (block.q if block.q is not None else torch.nn.functional.one_hot(
                torch.tensor(block.tokens), self.vocab).double()).numpy()
        elif block is not None and not self.params.cfg.greedy:
            q_tok = block.q_tok.numpy()
        alts = None
        if (self.siblings is not None and self.params.mode == "asym"
                and self.params.cfg.greedy and self.params.acceptance == "exact"):
            alts = self.siblings.choose(block, self.siblings.server_rows(
                self.max_tree_rows, self.free_rows))
            self.m.sibling_rows += sum(len(a) for a in alts or ())
        return wire.VerifyRequest(self.sid, seq, len(tokens), self.params.cfg.config_id,
                                  pending, toks, q_tok, q_full,
                                  int(tokens[-1]) if pending is None else None,
                                  self._channel_of(seq), alts)

    def _channel_of(self, seq: int) -> tuple | None:
        """The channel state block ``seq`` carries (semantic sessions only), taken on
        its first encoding and kept for re-encodings of the same block."""
        if self.params.acceptance != "semantic" or self.channel is None:
            return None
        if seq not in self._channels:
            self._channels[seq] = tuple(float(x) for x in self.channel())
            for old in [k for k in self._channels if k < seq - 1]:
                del self._channels[old]
        return self._channels[seq]

    async def verify(self, tokens: list[int], block: DraftBlock | None,
                     remaining: int, on_early=None) -> wire.VerifyResponse:
        """Send block ``seq``; an evicted or expired session (404) is re-created from
        ``tokens`` (the pending correction included; ``remaining`` new tokens at most)
        and the block resent. ``on_early(EarlyVerdict)``: FSD's provisional verdict of
        this block, when the cloud streams one (called at most once). Raises
        RemoteError, RuntimeError (an answer to another block)."""
        early = self._early_once(on_early)
        body = self.request(tokens, block).encode(self.vocab)
        try:
            data = await self.call("POST", self.path + "/verify", body, early)
        except RemoteError as e:
            if e.status != 404:
                raise
            await self.create(list(tokens), remaining)
            body = self.request(tokens, block).encode(self.vocab)
            data = await self.call("POST", self.path + "/verify", body, early)
        return self.decode_verdict(data)

    def _early_once(self, on_early):
        """``on_early`` filtered to this block's first early verdict (retries repeat
        it); counts its bytes. None when ``on_early`` is None."""
        if on_early is None:
            return None
        seq, seen = self.seq, []

        def deliver(v: frames.EarlyVerdict) -> None:
            self.m.downlink_bytes += len(v.encode())
            if v.block_seq == seq and not seen:
                seen.append(v)
                on_early(v)
        return deliver

    def decode_verdict(self, data: bytes) -> wire.VerifyResponse:
        resp = wire.VerifyResponse.decode(data)
        if resp.block_seq != self.seq:
            raise RuntimeError(f"response answers block {resp.block_seq}, sent {self.seq}")
        return resp

    async def correction(self, k: int | None) -> wire.CorrectionResponse:
        """More correction information for the block just answered: a top-``k``
        support, or the full target distribution (``k`` None)."""
        body = wire.CorrectionRequest(self.seq - 1, k).encode()
        data = await self.call("POST", self.path + "/correction", body)
        return wire.CorrectionResponse.decode(data)

    # ------------------------------------------------------------------ send ahead

    def send_ahead(self, assumed: list[int], block: DraftBlock, plan: int,
                   root: int) -> Ahead:
        """POST ``block`` (drafted on ``assumed`` = prefix + in-flight block + guessed
        bonus ``root``) as block ``seq + 1`` now, in the background."""
        body = self.request(assumed, block, ahead=True).encode(self.vocab)
        fut = asyncio.ensure_future(self._post_ahead(body, self.seq + 1))
        self.m.ahead_blocks += 1
        return Ahead(fut, block, plan, body, time.perf_counter(), root)

    async def _post_ahead(self, body: bytes, seq: int):
        """POST a block sent ahead. Returns ``(VerifyResponse, perf_counter)``, or None
        when the cloud refused it (409 ``stale_block`` on a miss) or it failed."""
        try:
            data = await self.call("POST", self.path + "/verify", body)
            resp = wire.VerifyResponse.decode(data)
        except (RemoteError, wire.WireError, *UNREACHABLE):
            return None
        return (resp, time.perf_counter()) if resp.block_seq == seq else None

    async def await_ahead(self, ahead: Ahead):
        """The verdict of a block sent ahead (a hit: the cloud verified it, or will
        when the same bytes are resent after a failure). Returns (response, time)."""
        got = await ahead.future
        if got is not None:
            self.m.ahead_hits += 1
            return got
        data = await self.call("POST", self.path + "/verify", ahead.body)
        return self.decode_verdict(data), time.perf_counter()

    def drop_ahead(self, ahead: Ahead | None) -> None:
        """A block sent ahead on an outcome that did not happen: the cloud refuses it
        (409, nothing changes); its answer is read in the background and ignored."""
        if ahead is not None:
            self.m.ahead_dropped += 1
            ahead.future.add_done_callback(lambda f: f.cancelled() or f.exception())
