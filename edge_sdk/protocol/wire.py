"""Wire format of the verification API (msgpack, versioned), shared by edge and cloud.

Hot-path messages (verify, correction) are msgpack *arrays* with packed binary fields so
the uplink carries O(g) small numbers per block (AsymSpec §IV-B); control messages
(session create/state, errors) are maps. Every decoder validates shape, types and ranges
and raises :class:`WireError` naming the offending field.

Create request (edge -> cloud, ``POST /v1/sessions``, a map; :data:`SESSION_FIELDS`):
    exactly one of ``prompt`` (text), ``prompt_ids`` (array of ints) or
    ``prompt_packed`` (bin: raw DEFLATE of the ids as LEB128 varints,
    :func:`pack_prompt`; ~0.6x the array's bytes on a 151,936-token vocabulary);
    a field equal to its default (:data:`SESSION_DEFAULTS`, the default sampling
    values) may be left out: on a short request the create is most of the uplink.
Verify request (edge -> cloud), per block of depth g:
    [MSG_VERIFY, session_id, block_seq, base_len, config_id, pending_commit|nil,
     tokens: bin (g ids, little-endian uint16 if V <= 65536 else uint32),
     q: bin (g float64, q_i(d_i)) | nil (greedy),
     q_full: bin (g*V float64, the "standard" baseline only) | nil,
     expect_last: int | nil,            (optional 10th element; absent = nil)
     channel: [rtt_s, uplink_bps, round_s] | nil,   (optional 11th element; absent = nil)
     alts: [m, positions: bin uint8 (n), ids: bin (n*m ids, token dtype)] | nil]
    ``alts`` (greedy, exact sessions only; optional 12th element) adds a sibling tree:
    at each listed draft position i the draft's m next-best tokens, alternatives to
    ``tokens[i]`` verified in the same pass (:mod:`edge_sdk.protocol.tree`).
    ``expect_last`` marks a block sent *ahead*: drafted from the assumed outcome of the
    previous block, which is still being verified (all of it accepted and this token as
    its bonus). The cloud verifies it only if its confirmed prefix then ends with
    ``expect_last`` at ``base_len``; otherwise it answers 409 ``stale_block`` and
    changes nothing.
    ``channel`` is the edge's link state, sent by sessions created with
    ``acceptance: "semantic"`` only (WISV §III-C: the cloud's acceptance threshold
    relaxes as the link worsens): three floats, the round-trip time in seconds
    [0, 60], the uplink rate in bits per second [1, 1e12] and the mean wall time of
    the edge's recent rounds in seconds [0, 3600]. An exact session's blocks never
    carry it (the cloud refuses one that does: 422, field ``channel``).
Verify response (cloud -> edge):
    [MSG_VERIFY_OK, block_seq, accepted, next_token|nil, correction|nil, base_len,
     target_s, near_ties, semantic, sibling]   (near_ties: optional 8th element,
                                               semantic: optional 9th, present for
                                               semantic sessions only, else nil when a
                                               sibling follows; sibling: optional 10th)
    next_token is a bonus token or a cloud-drawn correction, already committed by the
    cloud; ``sibling`` is the tree sibling accepted at position ``accepted`` (then
    ``next_token`` is the bonus after it); ``base_len`` is the cloud's confirmed length after this block. ``near_ties``
    lists the offsets (0 = first accepted draft) of committed greedy tokens chosen at a
    near-tie; ``semantic`` (WISV) the offsets of the accepted drafts that differ from
    the target's argmax and were accepted by the decision head: their count is the
    block's ``semantic_accepted_tokens``, and each offset is < ``accepted``. A correction
    (first rejection, sampling, compact mode) is
    [complete, support_ids: bin uint32, support_p: bin float64,
     proposal_ids: bin uint32, proposal_p: bin float64]
    and the edge sends the token it draws as ``pending_commit`` of its next block.
Streamed verify response (FSD; the request's ``Accept`` names :data:`STREAM_SEQ`):
    concatenated msgpack arrays, at most one early verdict then the final answer:
    [MSG_EARLY, block_seq, accepted, next_token|nil, layer, t_early]
        the provisional verdict read at an early exit of the target (layer ``layer``,
        ``t_early`` seconds into the pass); advisory only, it commits nothing
    the verify response above (the only item that decides), or
    [MSG_STREAM_ERROR, status, {"code", "message", "field"}]
        the pass failed after the early verdict was sent (the HTTP status was 200)
Correction request: [MSG_CORRECTION, block_seq, k|nil]  (nil -> full distribution)
Correction response: [MSG_CORRECTION_OK, block_seq, complete, ids: bin uint32 | nil,
                      p: bin float64]
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import msgpack
import numpy as np

WIRE_VERSION = 1
MSG_VERIFY, MSG_VERIFY_OK, MSG_CORRECTION, MSG_CORRECTION_OK = 1, 2, 3, 4
MSG_EARLY, MSG_STREAM_ERROR = 7, 8      # 5, 6: the target-only token stream
STREAM_SEQ = "application/x-msgpack-seq"
"""Content type of streamed answers: concatenated msgpack arrays (the items are in
:mod:`edge_sdk.protocol.frames`)."""
MAX_BODY_BYTES = 8 * 1024 * 1024


FULL_ROW_HEADROOM = 64 * 1024
"""Bytes of a verify body kept for everything but the full distributions (header,
token ids, q values, siblings) when sizing a standard block."""


def max_full_rows(vocab_size: int) -> int:
    """The most draft positions whose full draft distributions (``q_full``: g x V
    float64, the ``standard`` baseline's upload, Leviathan et al. 2023 as deployed
    edge-to-cloud) fit one verify body of :data:`MAX_BODY_BYTES`; at least 1.

    E.g. V = 151,936 (Qwen2.5): 6 rows (7.3 MB; 7 would be 8.5 MB). A standard session
    caps its blocks there, so a deeper draft depth shortens its blocks instead of
    getting 413 ``body_too_large``."""
    if vocab_size < 1:
        raise ValueError("vocab_size must be >= 1")
    return max(1, (MAX_BODY_BYTES - FULL_ROW_HEADROOM) // (8 * int(vocab_size)))


class WireError(ValueError):
    """A malformed message. ``field`` names what was wrong (for the 4xx JSON body)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(body: bytes):
    """msgpack -> Python objects, with size limits. Raises WireError('body', ...)."""
    if len(body) > MAX_BODY_BYTES:
        raise WireError("body", f"larger than {MAX_BODY_BYTES} bytes")
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True,
                               max_bin_len=MAX_BODY_BYTES, max_str_len=1 << 20,
                               max_array_len=1 << 20, max_map_len=1 << 10)
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError("body", f"not valid msgpack ({type(e).__name__})") from None


def _int(v, field: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise WireError(field, "expected an integer")
    if not lo <= v <= hi:
        raise WireError(field, f"out of range [{lo}, {hi}]")
    return v


def _bin(v, field: str, dtype, count: int | None = None) -> np.ndarray:
    if not isinstance(v, (bytes, bytearray)):
        raise WireError(field, "expected binary")
    dt = np.dtype(dtype)
    if len(v) % dt.itemsize:
        raise WireError(field, f"length not a multiple of {dt.itemsize}")
    arr = np.frombuffer(v, dtype=dt)
    if count is not None and arr.size != count:
        raise WireError(field, f"expected {count} values, got {arr.size}")
    return arr


def _probs(v, field: str, count: int, allow_zero: bool = False) -> np.ndarray:
    arr = _bin(v, field, "<f8", count)
    lo_ok = (arr >= 0) if allow_zero else (arr > 0)
    if not (np.isfinite(arr).all() and lo_ok.all() and (arr <= 1.0).all()):
        raise WireError(field, "probabilities must be finite and in (0, 1]"
                        if not allow_zero else "probabilities must be in [0, 1]")
    return arr


# ----------------------------------------------------------------------------- verify

@dataclass
class VerifyRequest:
    session_id: int
    block_seq: int
    base_len: int
    config_id: int
    pending_commit: int | None
    tokens: np.ndarray            # int [g]
    q_tok: np.ndarray | None      # float64 [g]
    q_full: np.ndarray | None     # float64 [g, V]
    expect_last: int | None = None    # sent ahead: the assumed bonus of the prior block
    #: semantic sessions only: (rtt_s seconds, uplink_bps bits/s, round_s seconds)
    channel: tuple | None = None
    alts: list[list[int]] | None = None   # [g] lists: siblings per draft position

    def encode(self, vocab_size: int) -> bytes:
        dt = token_dtype(vocab_size)
        m = [MSG_VERIFY, self.session_id, self.block_seq, self.base_len,
             self.config_id, self.pending_commit,
             np.asarray(self.tokens, dtype=dt).tobytes(),
             None if self.q_tok is None
             else np.asarray(self.q_tok, dtype="<f8").tobytes(),
             None if self.q_full is None
             else np.ascontiguousarray(self.q_full, dtype="<f8").tobytes()]
        tail = [None if self.expect_last is None else int(self.expect_last),
                None if self.channel is None else [float(x) for x in self.channel],
                _alts_to_wire(self.alts, dt)]
        while tail and tail[-1] is None:
            tail.pop()
        return pack(m + tail)

    @classmethod
    def decode(cls, body: bytes, vocab_size: int, max_block: int) -> "VerifyRequest":
        """Parse and validate. Raises WireError naming the field."""
        m = unpack(body)
        if not isinstance(m, list) or not 9 <= len(m) <= 12:
            raise WireError("body", "verify request must be a 9- to 12-element array")
        if m[0] != MSG_VERIFY:
            raise WireError("type", f"expected message type {MSG_VERIFY}")
        sid = _int(m[1], "session_id")
        seq = _int(m[2], "block_seq")
        base = _int(m[3], "base_len", 1)
        cfg = _int(m[4], "config_id", 0, 65535)
        pend = None if m[5] is None else _int(m[5], "pending_commit", 0, vocab_size - 1)
        toks = _bin(m[6], "tokens", token_dtype(vocab_size))
        g = toks.size
        if g > max_block:
            raise WireError("tokens", f"block of {g} exceeds the limit of {max_block}")
        if g and int(toks.max()) >= vocab_size:
            raise WireError("tokens", f"token id out of vocabulary (size {vocab_size})")
        q = None if m[7] is None else _probs(m[7], "q", g)
        qf = None
        if m[8] is not None:
            qf = _probs(m[8], "q_full", g * vocab_size, allow_zero=True).reshape(g, vocab_size)
            if g and not np.allclose(qf.sum(axis=1), 1.0, atol=1e-6):
                raise WireError("q_full", "each row must sum to 1")
        expect = (None if len(m) < 10 or m[9] is None
                  else _int(m[9], "expect_last", 0, vocab_size - 1))
        if expect is not None and pend is not None:
            raise WireError("expect_last", "a block sent ahead cannot carry pending_commit")
        chan = None if len(m) < 11 or m[10] is None else decode_channel(m[10])
        alts = (None if len(m) < 12 or m[11] is None
                else _alts_from_wire(m[11], toks, vocab_size))
        return cls(sid, seq, base, cfg, pend, toks.astype(np.int64), q, qf, expect, chan,
                   alts)


CHANNEL_RANGES = (("rtt_s", 0.0, 60.0), ("uplink_bps", 1.0, 1e12), ("round_s", 0.0, 3600.0))
"""The channel element's fields, in order, with their accepted ranges (seconds, bits
per second, seconds)."""


def decode_channel(v) -> tuple[float, float, float]:
    """Validate a verify request's ``channel`` element ``[rtt_s, uplink_bps, round_s]``
    (finite floats in :data:`CHANNEL_RANGES`). Raises WireError('channel', ...)."""
    if not isinstance(v, list) or len(v) != len(CHANNEL_RANGES):
        raise WireError("channel", "expected [rtt_s, uplink_bps, round_s]")
    for x, (name, lo, hi) in zip(v, CHANNEL_RANGES):
        if not isinstance(x, float) or not math.isfinite(x) or not lo <= x <= hi:
            raise WireError("channel", f"{name} must be a finite float in [{lo:g}, {hi:g}]")
    return tuple(v)


def _alts_to_wire(alts, dt) -> list | None:
    """``[m, positions, ids]`` of per-position sibling lists (None: no siblings).
    Raises ValueError when the non-empty lists differ in length."""
    if not alts or not any(alts):
        return None
    pos = [i for i, a in enumerate(alts) if a]
    ms = {len(alts[i]) for i in pos}
    if len(ms) != 1:
        raise ValueError("every position with siblings needs the same number")
    return [ms.pop(), np.asarray(pos, dtype="<u1").tobytes(),
            np.asarray([t for i in pos for t in alts[i]], dtype=dt).tobytes()]


def _alts_from_wire(v, toks: np.ndarray, vocab_size: int) -> list[list[int]]:
    """Validate ``[m, positions, ids]`` against the block ``toks`` [g]. Returns [g]
    lists. Raises WireError('alts', ...)."""
    from edge_sdk.protocol.limits import MAX_SIBLINGS

    if not isinstance(v, list) or len(v) != 3:
        raise WireError("alts", "expected [m, positions, ids]")
    m = _int(v[0], "alts", 1, MAX_SIBLINGS)
    pos = _bin(v[1], "alts", "<u1").astype(np.int64)
    ids = _bin(v[2], "alts", token_dtype(vocab_size), pos.size * m).astype(np.int64)
    g = toks.size
    if pos.size == 0 or (pos >= g).any() or (np.diff(pos) <= 0).any():
        raise WireError("alts", f"positions must be increasing draft indices < {g}")
    if (ids >= vocab_size).any():
        raise WireError("alts", f"token id out of vocabulary (size {vocab_size})")
    out: list[list[int]] = [[] for _ in range(g)]
    for k, i in enumerate(pos):
        row = [int(t) for t in ids[k * m:(k + 1) * m]]
        if len(set(row)) != m or int(toks[i]) in row:
            raise WireError("alts", f"siblings at position {i} must be distinct and "
                            "differ from the draft token")
        out[i] = row
    return out


@dataclass
class Correction:
    """Staged correction information for the first rejected position."""

    complete: bool              # support holds every token with p > 0
    support_ids: np.ndarray     # int [K], sorted by p desc, ties by id
    support_p: np.ndarray       # float64 [K]
    proposal_ids: np.ndarray    # int [N], i.i.d. draws Y ~ p
    proposal_p: np.ndarray      # float64 [N], p(Y)

    def to_wire(self) -> list:
        return [bool(self.complete), _u32(self.support_ids), _f64(self.support_p),
                _u32(self.proposal_ids), _f64(self.proposal_p)]

    @classmethod
    def from_wire(cls, m) -> "Correction":
        if not isinstance(m, list) or len(m) != 5 or not isinstance(m[0], bool):
            raise WireError("correction", "malformed")
        ids = _bin(m[1], "correction.support_ids", "<u4").astype(np.int64)
        p = _probs(m[2], "correction.support_p", ids.size)
        pid = _bin(m[3], "correction.proposal_ids", "<u4").astype(np.int64)
        pp = _probs(m[4], "correction.proposal_p", pid.size)
        return cls(m[0], ids, p, pid, pp)


def _u32(a) -> bytes:
    return np.asarray(a, dtype="<u4").tobytes()


def _f64(a) -> bytes:
    return np.asarray(a, dtype="<f8").tobytes()


@dataclass
class VerifyResponse:
    block_seq: int
    accepted: int
    next_token: int | None
    correction: Correction | None
    base_len: int
    target_s: float
    #: offsets (0 = first accepted draft) of the committed greedy tokens whose target
    #: top-2 logit gap was below the dtype's near-tie gap (``sampling.NEAR_TIE_GAP``):
    #: there a pass of another shape may pick another argmax. Greedy sessions only.
    near_ties: tuple = ()
    #: WISV, semantic sessions only (None for exact ones): offsets (0 = first accepted
    #: draft, each < ``accepted``) of the drafts accepted semantically, i.e. differing
    #: from the target's argmax and accepted by the decision head.
    semantic: tuple | None = None

    @property
    def semantic_accepted(self) -> int:
        """Tokens of this block accepted semantically (0 for exact sessions)."""
        return len(self.semantic or ())
    #: the tree sibling accepted at position ``accepted`` (then ``next_token`` is
    #: the bonus after it), or None
    sibling: int | None = None

    def encode(self) -> bytes:
        m = [MSG_VERIFY_OK, self.block_seq, self.accepted, self.next_token,
             None if self.correction is None else self.correction.to_wire(),
             self.base_len, float(self.target_s), [int(i) for i in self.near_ties]]
        if self.semantic is not None or self.sibling is not None:
            m.append(None if self.semantic is None else [int(i) for i in self.semantic])
        if self.sibling is not None:
            m.append(int(self.sibling))
        return pack(m)

    @property
    def new_tokens(self) -> int:
        """Tokens the verdict commits on the cloud (accepted drafts, the sibling, the
        next token; not an edge-drawn correction)."""
        return self.accepted + (self.sibling is not None) + (self.next_token is not None)

    @classmethod
    def decode(cls, body: bytes) -> "VerifyResponse":
        return cls.from_list(unpack(body))

    @classmethod
    def from_list(cls, m) -> "VerifyResponse":
        """Validate an unpacked response array. Raises WireError naming the field."""
        if not isinstance(m, list) or not 7 <= len(m) <= 10 or m[0] != MSG_VERIFY_OK:
            raise WireError("body", "not a verify response")
        ties = m[7] if len(m) >= 8 else []
        sib = None if len(m) < 10 or m[9] is None else _int(m[9], "sibling")
        if not isinstance(ties, list) or len(ties) > 4096:
            raise WireError("near_ties", "expected a list of offsets")
        ties = tuple(_int(i, "near_ties", 0, 4096) for i in ties)
        nxt = None if m[3] is None else _int(m[3], "next_token")
        corr = None if m[4] is None else Correction.from_wire(m[4])
        if (nxt is None) == (corr is None):
            raise WireError("next_token", "exactly one of next_token/correction expected")
        t = m[6]
        if not isinstance(t, float) or not math.isfinite(t):
            raise WireError("target_s", "expected a float")
        acc = _int(m[2], "accepted")
        sem = None
        if len(m) >= 9 and m[8] is not None:
            if not isinstance(m[8], list) or len(m[8]) > 4096:
                raise WireError("semantic", "expected a list of offsets")
            sem = tuple(_int(i, "semantic", 0, 4096) for i in m[8])
            if any(i >= acc for i in sem) or list(sem) != sorted(set(sem)):
                raise WireError("semantic", "offsets must be distinct, increasing and "
                                "below accepted")
        if sib is not None and nxt is None:
            raise WireError("sibling", "a sibling comes with its bonus next_token")
        return cls(_int(m[1], "block_seq"), acc, nxt, corr,
                   _int(m[5], "base_len"), t, ties, sem, sib)


# ----------------------------------------------------------------------------- correction

@dataclass
class CorrectionRequest:
    block_seq: int
    k: int | None  # None: the full distribution

    def encode(self) -> bytes:
        return pack([MSG_CORRECTION, self.block_seq, self.k])

    @classmethod
    def decode(cls, body: bytes, vocab_size: int) -> "CorrectionRequest":
        m = unpack(body)
        if not isinstance(m, list) or len(m) != 3 or m[0] != MSG_CORRECTION:
            raise WireError("body", "correction request must be [3, block_seq, k|nil]")
        k = None if m[2] is None else _int(m[2], "k", 1, vocab_size)
        return cls(_int(m[1], "block_seq"), k)


@dataclass
class CorrectionResponse:
    block_seq: int
    complete: bool
    ids: np.ndarray | None  # None: ``p`` is the full distribution [V]
    p: np.ndarray

    def encode(self) -> bytes:
        return pack([MSG_CORRECTION_OK, self.block_seq, bool(self.complete),
                     None if self.ids is None else _u32(self.ids), _f64(self.p)])

    @classmethod
    def decode(cls, body: bytes) -> "CorrectionResponse":
        m = unpack(body)
        if not isinstance(m, list) or len(m) != 5 or m[0] != MSG_CORRECTION_OK:
            raise WireError("body", "not a correction response")
        ids = None if m[3] is None else _bin(m[3], "ids", "<u4").astype(np.int64)
        p = _bin(m[4], "p", "<f8")
        if ids is not None and ids.size != p.size:
            raise WireError("p", "ids and p differ in length")
        return cls(_int(m[1], "block_seq"), bool(m[2]), ids, p)


# ----------------------------------------------------------------------------- sessions

SESSION_FIELDS = {"prompt", "prompt_ids", "prompt_packed", "chat", "sampling", "seed",
                  "max_new_tokens", "vocab_size", "tokenizer_hash", "mode", "support_k",
                  "n_proposals", "request_id", "acceptance"}
SESSION_DEFAULTS = {"seed": 0, "max_new_tokens": 256, "mode": "asym", "support_k": 32,
                    "n_proposals": 4, "acceptance": "exact"}
"""A create request's values when a field is absent: an encoder may leave out a field
that equals its default (the uplink carries only what differs)."""
PROMPT_IDS_FIELDS = ("prompt", "prompt_ids", "prompt_packed")
VARINT_MAX_BYTES = 5
"""Longest LEB128 varint of one token id (ids < 2**35)."""


def pack_prompt(ids) -> bytes:
    """Token ids -> ``prompt_packed``: raw DEFLATE (RFC 1951, no zlib header) of the ids
    as unsigned LEB128 varints (1 byte per id below 128, 3 below 2**21).

    For Qwen2.5's 151,936-token vocabulary, chat-templated HumanEval / MT-Bench prompts
    pack to ~0.6x the msgpack integer array of ``prompt_ids`` (3,597 vs 6,102 bytes over
    the bench's first 8 + 8 prompts, ``python -m bench.probes.create_bytes --prompts 8``):
    the create request is most of a short request's uplink. ``ids``: int
    sequence, each in [0, 2**35). Raises ValueError on an id out of that range."""
    a = np.asarray(ids, dtype=np.int64).reshape(-1)
    if a.size and (int(a.min()) < 0 or int(a.max()) >= 1 << (7 * VARINT_MAX_BYTES)):
        raise ValueError(f"token ids must be in [0, 2**{7 * VARINT_MAX_BYTES})")
    k = np.arange(VARINT_MAX_BYTES)                                     # byte index
    groups = (a[:, None] >> (7 * k)) & 0x7F                               # [n, 5]
    nbytes = 1 + (a[:, None] >= (1 << (7 * k[1:]))).sum(axis=1)           # [n] in 1..5
    cont = (k < nbytes[:, None] - 1) << 7                                 # continuation
    raw = (groups | cont).astype(np.uint8)[k < nbytes[:, None]].tobytes()
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return c.compress(raw) + c.flush()


def unpack_prompt(v, vocab_size: int, max_context: int) -> list[int]:
    """``prompt_packed`` -> token ids (the inverse of :func:`pack_prompt`), validated:
    1..``max_context`` ids, each < ``vocab_size``. The inflated size is bounded before
    it is produced (``max_context`` x 5 bytes), so a compression bomb costs nothing.
    Raises WireError('prompt_packed', ...)."""
    f = "prompt_packed"
    if not isinstance(v, (bytes, bytearray)) or not v:
        raise WireError(f, "expected non-empty binary (raw DEFLATE of LEB128 varints)")
    limit = max_context * VARINT_MAX_BYTES
    d = zlib.decompressobj(-15)
    try:
        raw = d.decompress(bytes(v), limit + 1)
    except zlib.error:
        raise WireError(f, "not a raw DEFLATE stream") from None
    if len(raw) > limit or d.unconsumed_tail:
        raise WireError(f, f"more than {max_context} token ids")
    if not d.eof or d.unused_data:
        raise WireError(f, "truncated or trailing data after the DEFLATE stream")
    b = np.frombuffer(raw, dtype=np.uint8)
    if b.size == 0 or b[-1] & 0x80:
        raise WireError(f, "empty, or the last varint is unterminated")
    ends = (b & 0x80) == 0
    gid = np.concatenate([[0], np.cumsum(ends)[:-1]])                     # varint index
    starts = np.flatnonzero(np.concatenate([[True], ends[:-1]]))
    pos = np.arange(b.size) - starts[gid]
    if int(pos.max()) >= VARINT_MAX_BYTES:
        raise WireError(f, f"a varint longer than {VARINT_MAX_BYTES} bytes")
    vals = np.add.reduceat((b & 0x7F).astype(np.int64) << (7 * pos), starts)
    if vals.size > max_context:
        raise WireError(f, f"more than {max_context} token ids")
    if int(vals.max()) >= vocab_size:
        raise WireError(f, f"token id out of vocabulary (size {vocab_size})")
    return vals.tolist()


ACCEPTANCE = ("exact", "semantic")
"""Session ``acceptance`` values: ``exact`` (default: the target's output, greedy token
for token, sampling in distribution) or ``semantic`` (WISV, lossy: a decision head may
accept a draft token the target would not have chosen; greedy configs only)."""
MAX_REQUEST_ID = 64
"""Longest ``request_id`` of a create request (characters)."""


def decode_session_request(m: dict, vocab_size: int, max_context: int) -> dict:
    """Validate a create-session body (already parsed from msgpack or JSON).

    Returns a normalised dict. Raises WireError naming the field.
    """
    if not isinstance(m, dict):
        raise WireError("body", "expected an object")
    unknown = set(m) - SESSION_FIELDS
    if unknown:
        raise WireError(sorted(map(str, unknown))[0], "unknown field")  # keys may be bytes
    out = {"chat": bool(m.get("chat", False))}
    if sum(k in m for k in PROMPT_IDS_FIELDS) != 1:
        raise WireError("prompt", "give exactly one of prompt (text), prompt_ids or "
                        "prompt_packed")
    if "prompt" in m:
        if not isinstance(m["prompt"], str) or not m["prompt"]:
            raise WireError("prompt", "expected a non-empty string")
        out["prompt"] = m["prompt"]
    elif "prompt_packed" in m:
        out["prompt_ids"] = unpack_prompt(m["prompt_packed"], vocab_size, max_context)
    else:
        ids = m["prompt_ids"]
        if not isinstance(ids, list) or not ids or len(ids) > max_context:
            raise WireError("prompt_ids", f"expected 1..{max_context} token ids")
        out["prompt_ids"] = [_int(t, "prompt_ids", 0, vocab_size - 1) for t in ids]
    from edge_sdk.protocol.sampling import SamplingConfig

    try:
        out["sampling"] = SamplingConfig.from_dict(m.get("sampling"))
    except (ValueError, TypeError) as e:
        raise WireError(str(e).split(":")[0] if ":" in str(e) else "sampling", str(e)) from None
    dflt = SESSION_DEFAULTS
    out["seed"] = _int(m.get("seed", dflt["seed"]), "seed")
    out["max_new_tokens"] = _int(m.get("max_new_tokens", dflt["max_new_tokens"]),
                                 "max_new_tokens", 1, max_context)
    # a mismatch with the target's vocabulary is the caller's check (422, like the
    # tokenizer hash): here only the type
    out["vocab_size"] = _int(m["vocab_size"], "vocab_size") if "vocab_size" in m else None
    out["tokenizer_hash"] = m.get("tokenizer_hash")
    if out["tokenizer_hash"] is not None and not isinstance(out["tokenizer_hash"], str):
        raise WireError("tokenizer_hash", "expected a string")
    mode = m.get("mode", dflt["mode"])
    if mode not in ("asym", "standard"):
        raise WireError("mode", "expected 'asym' or 'standard'")
    out["mode"] = mode
    out["support_k"] = _int(m.get("support_k", dflt["support_k"]), "support_k", 1, vocab_size)
    out["n_proposals"] = _int(m.get("n_proposals", dflt["n_proposals"]), "n_proposals", 0, 256)
    rid = m.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not 1 <= len(rid) <= MAX_REQUEST_ID):
        raise WireError("request_id", f"expected a string of 1..{MAX_REQUEST_ID} characters")
    out["request_id"] = rid
    acc = m.get("acceptance", dflt["acceptance"])
    if acc not in ACCEPTANCE:
        raise WireError("acceptance", "expected 'exact' or 'semantic'")
    out["acceptance"] = acc
    return out
