"""Edge client: draft a block, send it, apply the verdict, commit token by token.

Each round's draft depth comes from a depth controller (``edge_sdk.control``: fixed,
heuristic, CAAC of RAPID, UCB-SpecStop). Rounds are stop-and-wait, or proactive
(``edge_sdk.proactive``: RAPID's IPDG/NPDG) where the next block is drafted while the
current one is being verified. Output equals the target's: greedy token-for-token,
sampling in distribution (Leviathan et al. 2023 §2.3; AsymSpec §IV-B), whatever the
controller or proactive mode.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

import aiohttp
import numpy as np
import torch

from edge_sdk import correction as C
from edge_sdk.commit import Committer
from edge_sdk.control import (DepthController, FixedDepth, PlanContext, RoundRecord,
                              make_controller)
from edge_sdk.drafters.base import DraftBlock, Drafter
from edge_sdk.metrics import RequestMetrics
from edge_sdk.models import encode_prompt, tokenizer_fingerprint
from edge_sdk.protocol import wire
from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS, MAX_PROACTIVE_ROOTS
from edge_sdk.proactive import MODES as PROACTIVE_MODES
from edge_sdk.proactive import ProactiveResult, draft_generator, run_proactive
from edge_sdk.protocol.sampling import SamplingConfig
from edge_sdk.scheduler import DraftScheduler
from edge_sdk.transport import MSGPACK, RemoteError, Transport


CLOUD_LOSS_POLICIES = ("wait", "draft_only")
UNREACHABLE = (aiohttp.ClientConnectionError, asyncio.TimeoutError, ConnectionError)


class CloudUnreachable(ConnectionError):
    """The verification API could not be reached within ``offline_timeout_s``."""


@dataclass
class TokenEvent:
    """One committed token: id, the text it adds, and whether the target verified it."""

    token_id: int
    text: str
    verified: bool = True


@dataclass
class GenerationResult:
    """``verified[i]`` is False for a token produced by the draft alone while the cloud
    was unreachable (``on_cloud_loss="draft_only"``); every other token is the target's."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_ids: list[int]
    metrics: dict = field(default_factory=dict)
    verified: list[bool] = field(default_factory=list)

    @property
    def all_verified(self) -> bool:
        return all(self.verified)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "verified": self.verified,
                "metrics": self.metrics}


@dataclass
class _Ahead:
    """A proactive block sent before its predecessor's verdict (``send_ahead``)."""

    future: asyncio.Future       # -> (VerifyResponse, perf_counter) | None
    block: DraftBlock
    plan: int
    body: bytes                  # the exact request bytes (a resend replays them)
    t_sent: float
    root: int                    # the assumed bonus of the predecessor


class EdgeClient:
    """Speculative decoding against a specrelay verification API.

    Args:
        base_url: the API, e.g. ``http://127.0.0.1:8000``.
        drafter: a :class:`Drafter` (None allows only ``target_only`` generation).
        tokenizer: shared by draft and target (checked by fingerprint at session create).
        depth: draft depth gamma per block when no ``controller`` is given (fixed; clamped
            to 1..max_block of the server and to the tokens left).
        mode: ``asym`` (token, q pairs on the uplink; staged correction) or ``standard``
            (baseline: full q per position uploaded, cloud draws corrections).
        eps_req: request TV budget for bounded corrections (0 = exact).
        correction: ``auto`` or a forced stage ``bounded``/``proposal``/``full`` (tests).
        support_k, n_proposals: correction stage sizes requested from the cloud.
        signer: request signer (see ``edge_sdk.protocol.signing``) or None.
        chat: wrap text prompts in the tokenizer's chat template.
        scheduler: the :class:`DraftScheduler` granting draft compute to concurrent
            requests (one is made per client when None). Concurrent ``generate`` calls
            on one client form the confirmed-prefix pipeline: while one request waits
            for verification, another drafts.
        controller: draft-depth policy: a registry name (``fixed|heuristic|caac|
            ucb-specstop``, a fresh controller per request; ``controller_kw`` go to its
            constructor), a :class:`DepthController` (shared by every request of this
            client), or a zero-argument factory returning one. None: fixed ``depth``.
        proactive: ``off`` (stop-and-wait), ``ipdg`` (RAPID's interruptible proactive
            drafting: draft the next block while the current one is verified, stop at the
            first expansion step after the verdict) or ``npdg`` (the non-interruptible
            baseline). Proactive steps share the scheduler's draft worker but are not
            confirmed-prefix grants (they draft a descendant of an unresolved block).
        proactive_roots: b, the number of guessed bonus tokens (b > 1: a tree of b
            branches, each on its own drafter fork).
        send_ahead: pipelined verification (needs ``proactive``; chains only, b = 1):
            a proactive block completed while the previous block is still in flight is
            sent at once, marked with its assumed bonus (``expect_last``), so the cloud
            verifies it right after the previous block instead of one network round
            trip and a draft later. The cloud verifies it only if the previous block was
            fully accepted with that bonus (exactly the client's proactive hit); else
            it answers 409 ``stale_block``, changes nothing, and the edge drafts from
            the true prefix. At most two blocks of a request are in flight. The
            acceptance rule and the draws are unchanged (PipeSpec-style asynchronous
            pipelining of draft and verify stages; output identical to stop-and-wait).
        on_cloud_loss: what to do when the cloud cannot be reached (connection refused,
            timeouts) after the transport's retries. ``wait`` (default): keep retrying
            with backoff for up to ``offline_timeout_s`` seconds, then raise
            ``CloudUnreachable``; no unverified token is ever produced. ``draft_only``:
            continue with the draft alone, every such token flagged ``verified=False``
            (TokenEvent, GenerationResult.verified, the OpenAI endpoint), probing the
            cloud every ``probe_interval_s`` seconds; once it answers the request
            resumes from its full prefix (nothing lost or repeated) under verification.
        ssl_context: TLS context trusting the server's CA for ``https://`` (when no
            ``transport`` is given). A certificate error is raised at once
            (``edge_sdk.transport.TLSVerifyError``), never waited out.
    """

    def __init__(self, base_url: str, drafter: Drafter | None, tokenizer, *, depth: int = 4,
                 mode: str = "asym", eps_req: float = 0.0, correction: str = "auto",
                 support_k: int = 32, n_proposals: int = 4, signer=None, chat: bool = True,
                 transport: Transport | None = None, scheduler: DraftScheduler | None = None,
                 controller: str | DepthController | None = None,
                 controller_kw: dict | None = None, proactive: str = "off",
                 proactive_roots: int = 1, send_ahead: bool = False,
                 on_cloud_loss: str = "wait",
                 offline_timeout_s: float = 300.0, probe_interval_s: float = 1.0,
                 ssl_context=None):
        if mode not in ("asym", "standard"):
            raise ValueError("mode must be 'asym' or 'standard'")
        if correction not in C.MODES:
            raise ValueError(f"correction must be one of {C.MODES}")
        if proactive not in PROACTIVE_MODES:
            raise ValueError(f"proactive must be one of {PROACTIVE_MODES}")
        if not 1 <= int(proactive_roots) <= MAX_PROACTIVE_ROOTS:
            raise ValueError(f"proactive_roots must be in 1..{MAX_PROACTIVE_ROOTS}")
        if send_ahead and proactive == "off":
            raise ValueError("send_ahead needs proactive='ipdg' or 'npdg'")
        if on_cloud_loss not in CLOUD_LOSS_POLICIES:
            raise ValueError(f"on_cloud_loss must be one of {CLOUD_LOSS_POLICIES}")
        self.on_cloud_loss, self.offline_timeout_s = on_cloud_loss, offline_timeout_s
        self.probe_interval_s = probe_interval_s
        if isinstance(controller, str):
            make_controller(controller, **(controller_kw or {}))    # validate early
        self.controller, self.controller_kw = controller, dict(controller_kw or {})
        self.proactive, self.proactive_roots = proactive, int(proactive_roots)
        self.send_ahead = bool(send_ahead)
        self.drafter, self.tokenizer = drafter, tokenizer
        self.depth, self.mode, self.eps_req, self.correction = depth, mode, eps_req, correction
        self.support_k, self.n_proposals, self.chat = support_k, n_proposals, chat
        self.transport = transport or Transport(base_url, signer=signer,
                                                ssl_context=ssl_context)
        self.scheduler = scheduler or DraftScheduler()
        self._own_scheduler = scheduler is None
        self._drafter_in_use = False

    def _lease_drafter(self) -> Drafter:
        """The client's drafter for the first active request; concurrent requests get
        forks (own KV cache, shared weights)."""
        if self._drafter_in_use:
            return self.drafter.fork()
        self._drafter_in_use = True
        return self.drafter

    def _return_drafter(self, d: Drafter | None) -> None:
        if d is self.drafter:
            self._drafter_in_use = False

    async def close(self) -> None:
        await self.transport.close()
        if self._own_scheduler:
            self.scheduler.shutdown()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    def stream(self, prompt: str | None = None, **kw) -> "Generation":
        """An async iterable of :class:`TokenEvent`; ``.result()`` afterwards. Takes the
        arguments of :meth:`generate`."""
        return Generation(self, prompt, **kw)

    async def generate(self, prompt: str | None = None, **kw) -> GenerationResult:
        """Generate a completion.

        Args:
            prompt: text (chat-templated when ``chat``), or pass ``prompt_ids=[...]``.
            sampling: :class:`SamplingConfig` (default greedy); max_new_tokens (tokens);
            stop: stop strings; seed: RNG seed (edge and cloud draws);
            target_only: generate with the target alone (blocks of depth 0);
            depth: fixed draft depth for this request (overrides the controller);
            controller: depth controller for this request (as in :class:`EdgeClient`).
            on_round: ``(record: dict) -> None`` called after every verification round
                with its record (round, depth, planned, accepted, proactive_block,
                t_send / t_response / t_ready in seconds since the request started,
                proactive_steps, proactive_plan, hit); for tracing and benchmarks.
        Raises:
            RemoteError: the API refused a request (4xx) after retries.
        """
        gen = self.stream(prompt, **kw)
        async for _ in gen:
            pass
        return gen.result()


class Generation:
    """One request's round loop (async iterator of TokenEvents)."""

    def __init__(self, client: EdgeClient, prompt: str | None = None, *,
                 prompt_ids: Sequence[int] | None = None, sampling: SamplingConfig | None = None,
                 max_new_tokens: int = 128, stop: Sequence[str] = (), seed: int = 0,
                 target_only: bool = False, depth: int | None = None,
                 eps_req: float | None = None,
                 controller: str | DepthController | None = None, on_round=None):
        if (prompt is None) == (prompt_ids is None):
            raise ValueError("give exactly one of prompt or prompt_ids")
        self.c = client
        self.cfg = sampling or SamplingConfig()
        self.prompt_ids = (list(prompt_ids) if prompt_ids is not None
                           else encode_prompt(client.tokenizer, prompt, client.chat))
        self.max_new_tokens, self.stop, self.seed = max_new_tokens, list(stop), seed
        self.target_only = target_only or client.drafter is None
        self.depth = client.depth if depth is None else depth
        self.budget = client.eps_req if eps_req is None else eps_req
        self.m = RequestMetrics()
        self.gen = torch.Generator().manual_seed(seed)
        self.committer: Committer | None = None
        self.drafter = None if self.target_only else client._lease_drafter()
        self._leased = self.drafter
        self.ctrl = self._make_controller(controller, depth)
        self.round_idx = 0                      # verification rounds so far (draft RNG)
        self.max_block = MAX_DRAFT_TOKENS     # until the cloud says its own
        self._next: tuple | None = None         # kept proactive branch: (Branch, plan)
        self._ahead: _Ahead | None = None       # the kept branch's block, sent ahead
        self._forks: list[Drafter] = []         # extra drafters for proactive tree roots
        self._t_verdict: float | None = None    # perf_counter of the last verdict
        self.path: str | None = None
        self.verified: list[bool] = []
        self.offline = False                    # draft-only while the cloud is lost
        self.on_round = on_round                # per-round record hook (tracing)

    def _make_controller(self, spec, depth: int | None) -> DepthController:
        if depth is not None:
            return FixedDepth(depth)
        spec = spec if spec is not None else self.c.controller
        if spec is None:
            return FixedDepth(self.c.depth)
        if isinstance(spec, DepthController):
            return spec
        if isinstance(spec, str):
            kw = dict(self.c.controller_kw)
            if spec in ("fixed", "static"):
                kw.setdefault("depth", self.c.depth)
            return make_controller(spec, **kw)
        ctrl = spec()
        if not isinstance(ctrl, DepthController):
            raise TypeError("controller factory must return a DepthController")
        return ctrl

    def result(self) -> GenerationResult:
        cm = self.committer
        return GenerationResult(cm.text, list(cm.token_ids), cm.finish_reason,
                                self.prompt_ids, self.m.to_dict(), list(self.verified))

    # ------------------------------------------------------------------ session

    async def _call(self, method: str, path: str, body: bytes = b"") -> bytes:
        data, _ = await self.c.transport.request(method, path, body, MSGPACK)
        self.m.uplink_bytes += len(body)
        self.m.downlink_bytes += len(data)
        return data

    async def _create(self, prompt_ids: list[int], max_new: int) -> dict:
        c = self.c
        body = {"prompt_ids": prompt_ids, "sampling": self.cfg.to_dict(), "seed": self.seed,
                "max_new_tokens": max_new, "tokenizer_hash": tokenizer_fingerprint(c.tokenizer),
                "mode": c.mode, "support_k": c.support_k, "n_proposals": c.n_proposals}
        vocab = c.drafter.vocab_size if c.drafter is not None else len(c.tokenizer)
        body["support_k"] = max(1, min(c.support_k, vocab))      # K <= V
        if c.drafter is not None:
            body["vocab_size"] = c.drafter.vocab_size
        data = await self._call("POST", "/v1/sessions", wire.pack(body))
        info = wire.unpack(data)
        self.sid, self.vocab = int(info["session_id"]), int(info["vocab_size"])
        self.max_block = int(info.get("max_block", self.max_block))
        self.seq, self.pending = 0, None
        self.path = f"/v1/sessions/{self.sid}"
        return info

    async def _fetch(self, k: int | None):
        body = wire.CorrectionRequest(self.seq - 1, k).encode()
        data = await self._call("POST", self.path + "/correction", body)
        return wire.CorrectionResponse.decode(data)

    # ------------------------------------------------------------------ rounds

    def _plan(self, proactive: bool, after: int = 0) -> int:
        """The controller's depth for the next block, clamped to the server's max block
        and to the tokens left (``after``: tokens the in-flight block commits if fully
        accepted). 0: nothing to draft."""
        if self.target_only:
            return 0
        cap = min(self.max_block, self.committer.remaining - after - 1)
        if cap <= 0:
            return 0
        L = self.ctrl.next_depth(PlanContext(proactive=proactive, max_depth=cap))
        return max(1, min(int(L), cap))

    async def _draft(self, tokens: list[int], depth: int) -> DraftBlock | None:
        """Open a block: draft on the scheduler's worker once granted. None: nothing to
        draft (depth 0, or an n-gram drafter without a match: a plain target step)."""
        if depth <= 0:
            return None
        block = await self.c.scheduler.draft(self, len(self.committer.token_ids),
                                             self.drafter.propose, tokens, depth, self.cfg,
                                             draft_generator(self.seed, self.round_idx))
        return block if len(block) else None

    def _request(self, tokens: list[int], block: DraftBlock | None,
                 ahead: bool = False) -> wire.VerifyRequest:
        """The verify request of ``block`` on the confirmed prefix ``tokens``: the next
        block (``self.seq``, ``self.pending``), or with ``ahead`` the one after it (no
        correction can be pending on an assumed full acceptance). ``expect_last`` is the last
        confirmed token whenever no correction is pending, so a block sent ahead and the
        same block sent after its predecessor's verdict are the same bytes (a resend is
        answered from the cloud's replay cache)."""
        seq, pending = (self.seq + 1, None) if ahead else (self.seq, self.pending)
        toks = np.array(block.tokens if block else [], dtype=np.int64)
        q_tok = q_full = None
        if block is not None and self.c.mode == "standard":
            q_full = (block.q if block.q is not None else torch.nn.functional.one_hot(
                torch.tensor(block.tokens), self.vocab).double()).numpy()
        elif block is not None and not self.cfg.greedy:
            q_tok = block.q_tok.numpy()
        return wire.VerifyRequest(self.sid, seq, len(tokens), self.cfg.config_id,
                                  pending, toks, q_tok, q_full,
                                  int(tokens[-1]) if pending is None else None)

    async def _send(self, tokens, block) -> wire.VerifyResponse:
        body = self._request(tokens, block).encode(self.vocab)
        try:
            data = await self._call("POST", self.path + "/verify", body)
        except RemoteError as e:
            if e.status != 404:
                raise
            # session evicted/expired on the cloud: re-create it from the confirmed
            # prefix (the pending correction included) and resend the block
            await self._create(list(tokens), self.committer.remaining)
            body = self._request(tokens, block).encode(self.vocab)
            data = await self._call("POST", self.path + "/verify", body)
        return self._decode_verdict(data)

    def _decode_verdict(self, data: bytes) -> wire.VerifyResponse:
        resp = wire.VerifyResponse.decode(data)
        if resp.block_seq != self.seq:
            raise RuntimeError(f"response answers block {resp.block_seq}, sent {self.seq}")
        return resp

    async def _round(self, tokens: list[int]) -> list[int]:
        """One verification round (one open block); returns the newly confirmed tokens."""
        kept, self._next = self._next, None
        ahead, self._ahead = self._ahead, None
        if ahead is not None:           # proactive hit whose block is already sent
            try:
                return await self._verify_and_commit(tokens, ahead.block, ahead.plan,
                                                     True, ahead)
            finally:
                self.c.scheduler.close(self)
        if kept is not None:            # proactive hit: continue the kept branch
            branch, planned = kept
            planned = min(planned, max(0, self.committer.remaining - 1), self.max_block)
            have = len(branch.tokens)
            block = await self.c.scheduler.draft(self, len(self.committer.token_ids),
                                                 branch.finish, planned, self.cfg)
            cut = max(0, have - len(block))           # trimmed to the length cap
            self.m.proactive_wasted_tokens += cut
            block = block if len(block) else None
        else:
            planned = self._plan(False)
            block = await self._draft(tokens, planned)
        try:
            return await self._verify_and_commit(tokens, block, planned, kept is not None)
        finally:
            self.c.scheduler.close(self)      # committed or aborted: ready again

    async def _timed_send(self, tokens, block):
        resp = await self._send(tokens, block)
        return resp, time.perf_counter()

    def _send_ahead(self, tokens, block, pro: ProactiveResult | None,
                    verdict: asyncio.Future) -> "_Ahead | None":
        """Send the proactive chain's block now, if it is complete and the verdict it
        depends on is still pending (``send_ahead``). None when not sent."""
        if (not self.c.send_ahead or pro is None or len(pro.branches) != 1
                or verdict.done()):
            return None
        br = pro.branches[0]
        eos = self.committer.eos
        if (br.dead or len(br.tokens) != pro.plan or pro.plan <= 0
                or eos.intersection((block.tokens if block else []) + [br.root])):
            return None               # incomplete, or the request may end before it
        assumed = br.prefix           # tokens + block + guessed bonus
        blk = br.finish(pro.plan, self.cfg)
        body = self._request(assumed, blk, ahead=True).encode(self.vocab)
        ahead = _Ahead(asyncio.ensure_future(self._post_ahead(body, self.seq + 1)),
                       blk, pro.plan, body, time.perf_counter(), br.root)
        self.m.ahead_blocks += 1
        return ahead

    async def _post_ahead(self, body: bytes, seq: int):
        """POST a block sent ahead. Returns ``(VerifyResponse, perf_counter)``, or None
        when the cloud refused it (409 ``stale_block`` on a miss) or it failed."""
        try:
            data = await self._call("POST", self.path + "/verify", body)
            resp = wire.VerifyResponse.decode(data)
        except (RemoteError, wire.WireError, *UNREACHABLE):
            return None
        return (resp, time.perf_counter()) if resp.block_seq == seq else None

    async def _await_ahead(self, tokens, ahead: "_Ahead"):
        """The verdict of a block sent ahead (a hit: the cloud verified it, or will
        when the same bytes are resent after a failure)."""
        got = await ahead.future
        if got is not None:
            self.m.ahead_hits += 1
            return got
        data = await self._call("POST", self.path + "/verify", ahead.body)
        return self._decode_verdict(data), time.perf_counter()

    def _drop_ahead(self, ahead: "_Ahead | None") -> None:
        """A block sent ahead on an outcome that did not happen: the cloud refuses it
        (409, nothing changes); its answer is read in the background and ignored."""
        if ahead is not None:
            self.m.ahead_dropped += 1
            ahead.future.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _speculate(self, tokens, block, verdict) -> ProactiveResult | None:
        """IPDG/NPDG: draft the next block from the assumed prefix while ``verdict`` is
        pending. Best effort: a failure drops the branch (the verdict is still used)."""
        if self.c.proactive == "off" or self.target_only:
            return None
        g = len(block) if block else 0
        plan = self._plan(True, after=g + 1)
        if plan <= 0:
            return None
        b = self.c.proactive_roots
        while len(self._forks) < b - 1:
            self._forks.append(self.drafter.fork())
        seed, nxt = self.seed, self.round_idx + 1
        try:
            return await run_proactive(
                [self.drafter] + self._forks[:b - 1], self.c.scheduler.executor,
                list(tokens) + (list(block.tokens) if block else []), plan, self.cfg,
                lambda: draft_generator(seed, nxt), b, verdict,
                interruptible=self.c.proactive == "ipdg")
        except Exception:  # noqa: BLE001 - proactive drafting is an optimisation only
            return None

    async def _verify_and_commit(self, tokens: list[int], block: DraftBlock | None,
                                 planned: int = 0, from_branch: bool = False,
                                 ahead: "_Ahead | None" = None):
        m = self.m
        g = len(block) if block else 0
        t0 = time.perf_counter() if ahead is None else ahead.t_sent
        t_prev = self._t_verdict or m.t_start
        send = asyncio.ensure_future(self._timed_send(tokens, block) if ahead is None
                                     else self._await_ahead(tokens, ahead))
        nxt_ahead = None
        try:
            pro = await self._speculate(tokens, block, send)
            nxt_ahead = self._send_ahead(tokens, block, pro, send)
            resp, t_resp = await send
        except BaseException:
            send.cancel()
            self._drop_ahead(nxt_ahead)
            raise
        m.net_seconds += t_resp - t0 - resp.target_s
        a = resp.accepted
        new = list(block.tokens[:a]) if block else []
        self.pending, self.seq = None, self.seq + 1
        if resp.next_token is not None:
            new.append(resp.next_token)
            if g == 0:
                m.target_step_tokens += 1      # no draft: a plain target decode step
            elif a == g:
                m.bonus_tokens += 1
            else:
                m.correction_tokens += 1
        else:
            tok, stage, eps = await C.resolve(resp.correction, block.q[a], self.budget,
                                              self.gen, self._fetch, self.c.correction)
            self.budget -= eps
            m.tv_budget_spent += eps
            m.correction_mode_counts[stage] += 1
            m.correction_tokens += 1
            self.pending = tok
            new.append(tok)
        base = len(tokens) - len(self.prompt_ids)      # generated tokens before this round
        m.near_tie_positions.extend(base + i for i in resp.near_ties)
        m.rounds += 1
        m.drafted_tokens += g
        m.accepted_tokens += a
        m.accepted_hist.append(a)
        m.target_seconds += resp.target_s
        m.draft_seconds += block.draft_s if block else 0.0
        if resp.base_len != len(tokens) + len(new):  # pending correction included
            raise RuntimeError("edge and cloud disagree on the confirmed length")
        hit = a == g and resp.next_token is not None
        wasted = g - a + self._settle(pro, hit, resp.next_token)
        if nxt_ahead is not None and self._next is not None:   # the chain's hit
            self._ahead = nxt_ahead          # the cloud is verifying it already
        else:
            self._drop_ahead(nxt_ahead)
        t_end = time.perf_counter()
        self._t_verdict = t_end
        rec = RoundRecord(depth=g, accepted=a, committed=len(new),
                          bonus=a == g and resp.next_token is not None,
                          planned_depth=planned,
                          draft_s_per_token=block.draft_s / g if g else None,
                          resp_s=t_resp - t0, round_s=t_end - t_prev,
                          proactive=from_branch, wasted=wasted)
        self.ctrl.update(rec)
        m.depth_hist.append(planned)
        if self.on_round is not None:
            self.on_round({
                "round": self.round_idx, "depth": g, "planned": planned, "accepted": a,
                "proactive_block": from_branch, "t_send": t0 - m.t_start,
                "t_response": t_resp - m.t_start,
                "t_ready": None if pro is None else pro.t_ready - m.t_start,
                "proactive_steps": None if pro is None else pro.steps,
                "proactive_plan": None if pro is None else pro.plan,
                "hit": None if pro is None else self._next is not None})
        self.round_idx += 1
        return new

    def _settle(self, pro: ProactiveResult | None, all_accepted: bool,
                bonus: int | None) -> int:
        """Reconcile the proactive phase with the verdict; returns discarded tokens.

        Hit (every draft accepted and the bonus is a root): keep that branch for the next
        round and make its drafter fork the request's drafter (the KV "remap" is an
        ownership swap); miss: drop every branch (the next ``sync`` rolls the caches
        back to the true prefix)."""
        if pro is None:
            return 0
        m = self.m
        m.proactive_rounds += 1
        m.proactive_drafted_tokens += pro.drafted()
        m.proactive_late_steps += pro.late_steps
        kept, dropped = pro.settle(bonus if all_accepted else None)
        m.proactive_wasted_tokens += dropped
        if kept is not None and not self.committer.done:
            m.proactive_hits += 1
            if kept.drafter is not self.drafter:
                i = self._forks.index(kept.drafter)
                self._forks[i], self.drafter = self.drafter, kept.drafter
            self._next = (kept, pro.plan)
        elif kept is not None:
            m.proactive_wasted_tokens += len(kept.tokens)
            dropped += len(kept.tokens)
        return dropped

    # ------------------------------------------------------------------ cloud loss

    async def _online_round(self, tokens: list[int]) -> list[int] | None:
        """One verified round, riding out cloud loss per the client's policy. Returns
        None when the request must continue draft-only."""
        c = self.c
        deadline = time.monotonic() + c.offline_timeout_s
        delay = 0.1
        while True:
            seq, pending = self.seq, self.pending
            try:
                return await self._round(tokens)
            except UNREACHABLE:
                # the round did not complete here: restore the header state (a resent
                # block is answered from the cloud's cache; a lost session is re-created)
                self.seq, self.pending, self._next = seq, pending, None
                self._drop_ahead(self._ahead)
                self._ahead = None
                if c.on_cloud_loss == "draft_only":
                    return None
                if time.monotonic() + delay > deadline:
                    raise self._lost()
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)

    async def _until_reachable(self, fn):
        """``await fn()``, retrying with backoff while the cloud is unreachable, for up
        to ``offline_timeout_s`` (the first session create: nothing to draft from yet)."""
        deadline = time.monotonic() + self.c.offline_timeout_s
        delay = 0.1
        while True:
            try:
                return await fn()
            except UNREACHABLE:
                if time.monotonic() + delay > deadline:
                    raise self._lost() from None
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)

    def _lost(self) -> CloudUnreachable:
        t = self.c.offline_timeout_s
        return CloudUnreachable(
            f"cannot reach the verification API at {self.c.transport.base_url} (gave up "
            f"after {t:.0f} s: is it running? offline_timeout_s / --offline-timeout "
            "waits longer)")

    async def _offline_round(self, tokens: list[int]) -> list[int]:
        """Draft-only: probe the cloud (re-create the session from the full prefix) at
        most every ``probe_interval_s``; else one token from the draft alone."""
        now = time.monotonic()
        if now - self._last_probe >= self.c.probe_interval_s:
            self._last_probe = now
            try:
                await self._create(list(tokens), self.committer.remaining)
                self.offline = False
                return []
            except UNREACHABLE:
                pass
        block = await self.c.scheduler.draft(self, len(self.committer.token_ids),
                                             self.drafter.propose, tokens, 1, self.cfg,
                                             draft_generator(self.seed, 10**6 + len(tokens)))
        self.c.scheduler.close(self)
        self.m.unverified_tokens += 1
        return list(block.tokens)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        c, m = self.c, self.m
        m.t_start = time.perf_counter()
        self._last_probe = time.monotonic()
        tokens = list(self.prompt_ids)
        try:
            # Prefill the draft's KV cache on the draft worker while the cloud prefills
            # the target (the first block then drafts from a warm cache).
            warm = (asyncio.get_running_loop().run_in_executor(
                c.scheduler.executor, self.drafter.sync, self.prompt_ids)
                if self.drafter is not None and len(self.prompt_ids) > 1 else None)
            try:
                info = await self._until_reachable(
                    lambda: self._create(self.prompt_ids, self.max_new_tokens))
            finally:
                if warm is not None:
                    await warm
            self.committer = Committer(c.tokenizer, self.max_new_tokens,
                                       info.get("eos_token_ids", []), self.stop)
            while not self.committer.done:
                if self.offline:
                    new, ok = await self._offline_round(tokens), False
                else:
                    new, ok = await self._online_round(tokens), True
                    if new is None:
                        if self.target_only:
                            raise CloudUnreachable("cloud lost and no draft model")
                        self.offline, new = True, []
                        self._last_probe = time.monotonic()
                tokens += new
                for t in new:
                    if self.committer.done:
                        break
                    text = self.committer.push(t)
                    m.committed_tokens += 1
                    m.first_token()
                    self.verified.append(ok)
                    yield TokenEvent(t, text, ok)
                m.wasted_draft_tokens = (m.drafted_tokens - m.accepted_tokens
                                         + m.proactive_wasted_tokens)
            self._drop_ahead(self._ahead)     # the request ended before it was needed
            self._ahead = None
            if self._next is not None:        # a kept branch outlived the request
                m.proactive_wasted_tokens += len(self._next[0].tokens)
                m.wasted_draft_tokens += len(self._next[0].tokens)
                self._next = None
        finally:
            m.finish()
            c._return_drafter(self._leased)
            if self.path is not None and not self.offline:
                try:
                    await self._call("DELETE", self.path)
                except Exception:  # noqa: BLE001 - cleanup is best effort; TTL evicts
                    pass
