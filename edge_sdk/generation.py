"""One request's round loop: draft a block, have the target verify it, commit the verdict.

A round: the depth controller plans the draft depth, the drafter proposes a block on
the scheduler's draft worker, the block goes to the cloud (:mod:`edge_sdk.session`),
and the verdict (:mod:`edge_sdk.rounds`) commits the accepted drafts plus the bonus or
correction token. With proactive drafting (:mod:`edge_sdk.proactive`, RAPID's IPDG /
NPDG) the next block is drafted while the current one is verified, and with
``send_ahead`` sent before its predecessor's verdict (PipeSpec-style pipelining). A
lost cloud is handled by the request's policy (:mod:`edge_sdk.offline`). Every draw
comes from :func:`edge_sdk.protocol.rng.generator`, so a seeded run replays.
A request with ``acceptance="semantic"`` (WISV, lossy; greedy only) reports its channel
state with each block (:mod:`edge_sdk.channel`) and marks the tokens the cloud accepted
semantically.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Iterator, Sequence

from edge_sdk import correction as C
from edge_sdk import rounds
from edge_sdk.channel import ChannelEstimator
from edge_sdk.commit import Committer
from edge_sdk.control import PlanContext
from edge_sdk.drafters.base import DraftBlock
from edge_sdk.metrics import RequestMetrics
from edge_sdk.models import encode_prompt, tokenizer_fingerprint
from edge_sdk.offline import CloudLoss
from edge_sdk.proactive import EARLY_MODES, Lookahead, ProactiveResult, hit_chance
from edge_sdk.protocol import rng
from edge_sdk.protocol.sampling import SamplingConfig
from edge_sdk.protocol.wire import ACCEPTANCE
from edge_sdk.results import CloudUnreachable, GenerationResult, TokenEvent
from edge_sdk.session import Ahead, RemoteSession, SessionParams, new_request_id


PREFILL_STEPS = ("greedy", "always", "off")
"""``EdgeClient(prefill_steps=...)``: which requests take target steps while the draft
is still prefilling the prompt (:meth:`Generation._open`)."""
PREFILL_GRACE_S = 0.1
"""Seconds a request waits, once its session is open, for a draft prefill still
running before it takes target steps instead. A step (a round trip plus a one-token
target pass: ~150-250 ms on the default pair) started just before the prefill ends
delays the first speculative round by up to its own length for one token, about what
speculation commits in ~100 ms there; a shorter wait would also make the round
structure of a fast device depend on scheduling noise."""


class Generation:
    """One request (async iterator of :class:`TokenEvent`; :meth:`result` afterwards).
    Made by ``EdgeClient.stream``, which documents the arguments."""

    def __init__(self, client, prompt: str | None = None, *,
                 prompt_ids: Sequence[int] | None = None,
                 sampling: SamplingConfig | dict | None = None,
                 max_new_tokens: int = 128, stop: str | Sequence[str] = (),
                 seed: int | None = None, target_only: bool = False,
                 depth: int | None = None, eps_req: float | None = None, controller=None,
                 on_round=None, acceptance: str | None = None):
        if client.closed:
            raise RuntimeError("this EdgeClient is closed (its `async with` block ended or "
                               "close() was called): make a new one")
        self.c = client
        self.cfg = request_sampling(sampling)
        self.acceptance = client.acceptance if acceptance is None else acceptance
        check_acceptance(self.acceptance, self.cfg)
        self.stop = request_stop(stop)
        self.max_new_tokens = request_max_new_tokens(max_new_tokens)
        self.seed = request_seed(seed)
        check_prompt(prompt, prompt_ids)
        self.prompt_ids = (list(prompt_ids) if prompt_ids is not None
                           else encode_prompt(client.tokenizer, prompt, client.chat))
        self.target_only = target_only or client.drafter is None
        self.budget = client.eps_req if eps_req is None else eps_req   # TV budget left
        self.m = RequestMetrics()
        self.committer: Committer | None = None
        self._leased = None if self.target_only else client._lease_drafter()
        self.pro = Lookahead(self._leased, client.proactive, client.proactive_roots)
        self.ctrl, self._ctrl_key = client._request_controller(controller, depth,
                                                               self.cfg.greedy)
        self.channel = ChannelEstimator(client.link)
        self.sess = RemoteSession(client.transport, self._params(), self.m,
                                  self.channel.state)
        self.sess.siblings = client.siblings
        self._recreate_rid: tuple[int, str] | None = None   # (prefix length, request id)
        self.loss = CloudLoss(client.on_cloud_loss, client.offline_timeout_s,
                              client.probe_interval_s, client.transport)
        self.round_idx = 0                      # verification rounds so far (the draws)
        self._ahead: Ahead | None = None        # the kept branch's block, sent ahead
        self._first: tuple[DraftBlock, int] | None = None   # round 0's block (_open)
        #: the draft's prompt prefill (and round 0's block), still running when the
        #: session opened: rounds are target steps until it is done (``prefill_steps``)
        self._warming: asyncio.Future | None = None
        self._prefilled = asyncio.Event()       # the draft's prompt prefill is done
        self._t_verdict: float | None = None    # perf_counter of the last verdict
        self.verified: list[bool] = []
        self.semantic: list[bool] = []          # per committed token: accepted semantically
        self._marks: set[int] = set()           # the last round's semantic offsets
        self.on_round = on_round                # per-round record hook (tracing)

    def _params(self) -> SessionParams:
        c = self.c
        draft_vocab = c.drafter.vocab_size if c.drafter is not None else None
        return SessionParams(self.cfg, self.seed, c.mode, c.support_k, c.n_proposals,
                             tokenizer_fingerprint(c.tokenizer), draft_vocab,
                             draft_vocab if draft_vocab is not None else len(c.tokenizer),
                             self.acceptance)

    def result(self) -> GenerationResult:
        """The request's result once the stream has been iterated (to its end, or to
        where the caller stopped: then ``finish_reason`` is None and the text is what
        was streamed). Raises RuntimeError before the first iteration."""
        cm = self.committer
        if cm is None:
            raise RuntimeError("result() comes after the stream has been iterated "
                               "(`async for ev in gen: ...`, then gen.result())")
        return GenerationResult(cm.text, list(cm.token_ids), cm.finish_reason,
                                self.prompt_ids, self.m.to_dict(), list(self.verified),
                                self.acceptance, list(self.semantic), self.seed)

    # ------------------------------------------------------------------ the loop

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        m = self.m
        m.t_start = time.perf_counter()
        tokens = list(self.prompt_ids)
        try:
            await self._open()
            while not self.committer.done:
                new, ok = await self._next_tokens(tokens)
                tokens += new
                for ev in self._commit(new, ok):
                    yield ev
                m.wasted_draft_tokens = (m.drafted_tokens - m.accepted_tokens
                                         + m.proactive_wasted_tokens)
            self._discard_lookahead()
        finally:
            await self._close()

    async def _open(self) -> None:
        """Create the cloud session (waiting for the cloud as the policy allows) while
        the draft prefills its KV cache and drafts the first block from the prompt.

        The target's prefill (seconds on a long prompt) hides the first block's
        drafting, which would otherwise sit between the prefill and the first
        verification and add a whole block's draft time to the TTFT. The block uses
        the draws of round 0 (the same ones the first round would use), so outputs
        are unchanged.

        When the session is open but the draft is still prefilling (a busy or slow
        device, a long prompt: the draft's prefill can outlast the target's) and the
        client's ``prefill_steps`` is on, the request does not wait: its rounds are
        target steps (an empty block; the cloud answers its own next token) until the
        prefill is done, and speculation starts on the round after. A target step
        commits exactly the token the target alone would, so the output is
        unchanged; the TTFT becomes the target's own."""
        first = (asyncio.ensure_future(self._draft_first(self.prompt_ids))
                 if self.pro.drafter is not None else None)
        rid = new_request_id()             # one create, however often it is retried
        try:
            info = await self.loss.until_reachable(
                lambda: self.sess.create(self.prompt_ids, self.max_new_tokens, rid))
        except BaseException:
            if first is not None:           # the create's error is the one to raise
                await asyncio.gather(first, return_exceptions=True)
            raise
        self.committer = Committer(self.c.tokenizer, self.max_new_tokens,
                                   info.get("eos_token_ids", []), self.stop)
        if first is None:
            return
        steps = self.c.prefill_steps == "always" or (
            self.c.prefill_steps == "greedy" and self.cfg.greedy)
        if steps and not self._prefilled.is_set():
            try:            # a prefill about to end is worth waiting for (a step is not)
                await asyncio.wait_for(self._prefilled.wait(), PREFILL_GRACE_S)
            except asyncio.TimeoutError:
                pass
        if first.done() or self._prefilled.is_set() or not steps:
            self._first = await first
        else:
            self._warming = first

    async def _draft_first(self, prompt: list[int]) -> tuple[DraftBlock, int] | None:
        """Prefill the draft on ``prompt`` and draft round 0's block (unless target
        steps started meanwhile: the prompt is then no longer the prefix). Returns
        (block, planned depth) or None (nothing to draft)."""
        drafter = self.pro.drafter
        if len(prompt) > 1:
            await asyncio.get_running_loop().run_in_executor(
                self.c.scheduler.executor, drafter.sync, prompt)
        self._prefilled.set()
        if self._warming is not None:        # target steps started: the prompt is stale
            return None
        planned = self._plan(False, remaining=self.max_new_tokens)
        try:
            block = await self._draft(prompt, planned, self.round_idx)
        finally:
            self.c.scheduler.close(self)     # held by this request, not an open block
        return None if block is None else (block, planned)

    def _take_first(self, tokens: list[int]) -> tuple[DraftBlock, int] | None:
        """Round 0's block drafted during the create, cut to the cloud's max block and
        the tokens left; None when it does not apply (a later round: the request went
        offline first; its tokens count as wasted)."""
        first, self._first = self._first, None
        if first is None:
            return None
        block, planned = first
        cap = self._cap()
        if len(tokens) != len(self.prompt_ids) or cap <= 0:
            self.m.proactive_wasted_tokens += len(block)
            return None
        return block.head(cap), min(planned, cap)

    async def _next_tokens(self, tokens: list[int]) -> tuple[list[int], bool]:
        """The next confirmed tokens and whether the target verified them."""
        if self.loss.offline:
            local = self.loss.policy == "local"
            if self._recreate_rid is None or self._recreate_rid[0] != len(tokens):
                # one id per re-created prefix: a probe that timed out and the next
                # one share the cloud's prefill; a longer prefix is another create
                self._recreate_rid = (len(tokens), new_request_id())
            rid = self._recreate_rid[1]
            return await self.loss.offline_step(
                lambda: self.sess.create(list(tokens), self.committer.remaining, rid),
                (lambda: self._local_offline(tokens)) if local
                else (lambda: self._draft_offline(tokens))), local
        header = self.sess.header()

        def aborted():
            # the round did not complete: restore the header state (a resent block is
            # answered from the cloud's cache; a lost session is re-created)
            self.sess.restore(header)
            self.pro.kept = None
            self.sess.drop_ahead(self._ahead)
            self._ahead = None

        new = await self.loss.verified(lambda: self._round(tokens), aborted)
        if new is None:
            if self.target_only and self.loss.policy != "local":
                raise CloudUnreachable("cloud lost and no draft model")
            self.loss.go_offline()
            return [], True
        return new, True

    def _commit(self, new: list[int], verified: bool) -> Iterator[TokenEvent]:
        marks, self._marks = self._marks, set()
        for i, t in enumerate(new):
            if self.committer.done:
                break
            text = self.committer.push(t)
            self.m.committed_tokens += 1
            sem = i in marks
            self.m.semantic_accepted_tokens += sem
            self.m.first_token()
            self.verified.append(verified)
            self.semantic.append(sem)
            yield TokenEvent(t, text, verified, sem)

    def _discard_lookahead(self) -> None:
        """The request ended: a block sent ahead, a kept branch or an unused round-0
        block is wasted."""
        if self._first is not None:
            self.m.proactive_wasted_tokens += len(self._first[0])
            self.m.wasted_draft_tokens += len(self._first[0])
            self._first = None
        self.sess.drop_ahead(self._ahead)
        self._ahead = None
        kept = self.pro.take_kept()
        if kept is not None:
            self.m.proactive_wasted_tokens += len(kept[0].tokens)
            self.m.wasted_draft_tokens += len(kept[0].tokens)

    async def _close(self) -> None:
        self.m.finish()
        if self._warming is not None:    # the request ended on target steps: the draft
            w, self._warming = self._warming, None  # is still prefilling: stop it at its
            drafter = self.pro.drafter        # next chunk border, hand it back once free
            drafter.stop_prefill(True)        # (a cancel here cancels only this wait,
            try:                              # never the prefill)
                await asyncio.wait({w})
            finally:
                if w.done():                  # no prefill left that could see the flag
                    drafter.stop_prefill(False)
            if not w.cancelled():
                w.exception()                 # retrieved: the request itself succeeded
        self.c._return_drafter(self._leased)
        self.c._keep_controller(self._ctrl_key, self.ctrl)
        if self.sess.path is not None and not self.loss.offline:
            try:
                await self.sess.delete()
            except Exception:  # noqa: BLE001 - cleanup is best effort; TTL evicts
                pass

    # ------------------------------------------------------------------ one round

    async def _round(self, tokens: list[int]) -> list[int]:
        """One verification round (one open block); returns the newly confirmed tokens."""
        if self._warming is not None:
            if not self._warming.done():        # the draft is still prefilling
                return await self._verify(tokens, None, 0)
            warming, self._warming = self._warming, None
            warming.result()                    # a failed prefill raises here
        kept = self.pro.take_kept()
        ahead, self._ahead = self._ahead, None
        try:
            if ahead is not None:       # proactive hit whose block is already sent
                return await self._verify(tokens, ahead.block, ahead.plan, True, ahead)
            first = self._take_first(tokens) if kept is None else None
            block, planned = (first if first is not None
                              else await self._open_block(tokens, kept))
            return await self._verify(tokens, block, planned, kept is not None)
        finally:
            self.c.scheduler.close(self)      # committed or aborted: ready again

    def _plan(self, proactive: bool, after: int = 0, remaining: int | None = None,
              exposed: bool = False) -> int:
        """The controller's depth for the next block, clamped to the server's max block
        and to the tokens left (``after``: tokens the in-flight block commits if fully
        accepted; ``remaining``: tokens left when there is no committer yet;
        ``exposed``: nothing hides its drafting, see :class:`PlanContext`). 0: nothing
        to draft."""
        if self.target_only:
            return 0
        cap = self._cap(after, remaining)
        if cap <= 0:
            return 0
        depth = self.ctrl.next_depth(PlanContext(proactive=proactive, max_depth=cap,
                                                 exposed=exposed))
        return max(1, min(int(depth), cap))

    def _cap(self, after: int = 0, remaining: int | None = None) -> int:
        """The largest block the next round may send: the server's max block and the
        tokens left (``remaining``, else the committer's) minus ``after`` and the bonus."""
        left = self.committer.remaining if remaining is None else remaining
        return min(self.sess.max_block, left - after - 1)

    async def _open_block(self, tokens: list[int], kept) -> tuple[DraftBlock | None, int]:
        """The round's block (None: a plain target step) and its planned depth: the
        branch kept from a proactive hit continued to its plan, or a fresh draft."""
        if kept is None:
            planned = self._plan(False, exposed=self.pro.mode != "off")
            return await self._draft(tokens, planned, self.round_idx), planned
        branch, planned = kept
        planned = min(planned, max(0, self.committer.remaining - 1), self.sess.max_block)
        have = len(branch.tokens)
        block = await self.c.scheduler.draft(self, len(self.committer.token_ids),
                                             branch.finish, planned, self.cfg)
        self.m.proactive_wasted_tokens += max(0, have - len(block))   # trimmed to the cap
        return (block if len(block) else None), planned

    async def _draft(self, tokens: list[int], depth: int, index: int,
                     stream: int = rng.DRAFT) -> DraftBlock | None:
        """Draft ``depth`` tokens on the scheduler's worker once granted, with the draws
        of ``(seed, stream, index)``. None: nothing to draft (depth 0, or an n-gram
        drafter without a match)."""
        if depth <= 0:
            return None
        committed = 0 if self.committer is None else len(self.committer.token_ids)
        block = await self.c.scheduler.draft(self, committed,
                                             self.pro.drafter.propose, tokens, depth,
                                             self.cfg, rng.generator(self.seed, stream, index))
        return block if len(block) else None

    async def _draft_offline(self, tokens: list[int]) -> list[int]:
        """One token from the draft alone (the cloud is lost)."""
        block = await self._draft(tokens, 1, len(tokens), rng.DRAFT_OFFLINE)
        self.c.scheduler.close(self)
        self.m.unverified_tokens += 1
        return list(block.tokens) if block else []

    async def _local_offline(self, tokens: list[int]) -> list[int]:
        """One round on the device's own target (the cloud is lost): exact tokens."""
        new = await asyncio.get_running_loop().run_in_executor(
            self.c.scheduler.executor, self.c.local_target.step, list(tokens),
            self.committer.remaining, self.cfg, self.seed)
        self.m.local_tokens += len(new)
        return new

    async def _verify(self, tokens: list[int], block: DraftBlock | None, planned: int,
                      from_branch: bool = False, ahead: Ahead | None = None) -> list[int]:
        """Verify ``block`` on ``tokens`` (or await the one sent ahead), apply the
        verdict, settle the proactive phase, and inform the controller."""
        t_sent = time.perf_counter() if ahead is None else ahead.t_sent
        cycle = self._t_verdict is not None   # False: the request's first round
        t_prev = self._t_verdict if cycle else self.m.t_start
        resp, t_resp, pro, nxt_ahead = await self._exchange(tokens, block, ahead)
        self.m.net_seconds += t_resp - t_sent - resp.target_s
        out = rounds.apply_verdict(block, resp)
        self.sess.advance()
        new = out.tokens
        if out.kind == rounds.EDGE_CORRECTION:
            new = new + [await self._correct(resp, block, out.accepted)]
        rounds.count_verdict(self.m, out, resp, block, len(tokens) - len(self.prompt_ids))
        rounds.check_confirmed_length(resp, tokens, new)
        self._count_early(pro, resp, t_resp)
        wasted = out.depth - out.accepted + self.pro.settle(
            pro, list(tokens) + new, self.committer.done, self.m)
        if nxt_ahead is not None and self.pro.kept is not None:   # the chain's hit
            self._ahead = nxt_ahead          # the cloud is verifying it already
        else:
            self.sess.drop_ahead(nxt_ahead)
        self._t_verdict = time.perf_counter()
        times = rounds.RoundTimes(t_prev, t_sent, t_resp, self._t_verdict, cycle)
        self._record(out, len(new), planned, block, times, from_branch, wasted, pro)
        # a block sent ahead waited behind its predecessor: no network figure of its own
        self.channel.observe(None if ahead is not None else t_resp - t_sent - resp.target_s,
                             times.end - times.prev)
        self.round_idx += 1
        self._marks = set(resp.semantic or ())   # offsets of accepted drafts = of new
        return new

    def _count_early(self, pro: ProactiveResult | None, resp, t_resp: float) -> None:
        """FSD: count the round's early verdict and whether it predicted the final."""
        ev = None if pro is None else pro.early
        if ev is None:
            return
        self.m.early_verdicts += 1
        self.m.early_hits += (ev.accepted, ev.next_token) == (resp.accepted,
                                                              resp.next_token)
        self.m.early_lead_s += max(0.0, t_resp - pro.t_early)

    async def _exchange(self, tokens, block, ahead):
        """Send the block (or await the one sent ahead) while the next one is drafted
        proactively, and maybe sent ahead. Returns (response, perf_counter of the
        response, ProactiveResult or None, the next Ahead or None)."""
        early = (asyncio.get_running_loop().create_future()
                 if ahead is None and self.c.proactive in EARLY_MODES else None)

        def on_early(ev) -> None:
            if not early.done():
                early.set_result(ev)

        send = asyncio.ensure_future(
            self._timed_send(tokens, block, on_early if early is not None else None)
            if ahead is None else self.sess.await_ahead(ahead))
        nxt_ahead = None
        try:
            pro = await self._speculate(tokens, block, send, early)
            nxt_ahead = self._send_ahead(block, pro, send)
            resp, t_resp = await send
        except BaseException:
            send.cancel()
            self.sess.drop_ahead(nxt_ahead)
            raise
        return resp, t_resp, pro, nxt_ahead

    async def _timed_send(self, tokens, block, on_early=None):
        resp = await self.sess.verify(tokens, block, self.committer.remaining, on_early)
        return resp, time.perf_counter()

    async def _correct(self, resp, block: DraftBlock, a: int) -> int:
        """Draw the correction token of rejected position ``a`` on the edge (staged
        correction, AsymSpec §IV-B); it rides on the next block as ``pending``."""
        gen = rng.generator(self.seed, rng.CORRECTION, self.round_idx)
        tok, stage, eps = await C.resolve(resp.correction, block.q[a], self.budget, gen,
                                          self.sess.correction, self.c.correction)
        self.budget -= eps
        rounds.count_correction(self.m, stage, eps)
        self.sess.pending = tok
        return tok

    def _record(self, out, committed, planned, block, times, from_branch, wasted, pro):
        """Inform the depth controller and the ``on_round`` hook of one round."""
        self.ctrl.update(rounds.round_record(out, committed, planned, block, times,
                                             from_branch, wasted))
        self.m.depth_hist.append(planned)
        if self.on_round is not None:
            self.on_round(rounds.trace_record(self.round_idx, out, planned, from_branch,
                                              times, self.m.t_start, pro,
                                              self.pro.kept is not None))

    # ------------------------------------------------------------------ proactive

    async def _speculate(self, tokens, block, verdict, early=None) -> ProactiveResult | None:
        """IPDG/NPDG: draft the next block from the assumed prefix (``tokens`` + block,
        fully accepted, + a guessed bonus) while ``verdict`` is pending; FSD: from the
        provisional prefix of the ``early`` verdict."""
        if self.c.proactive == "off" or self.target_only or self._warming is not None:
            return None
        g = len(block) if block else 0
        if g and self.c.proactive_min_hit and hit_chance(block) < self.c.proactive_min_hit:
            self.m.proactive_skipped += 1       # a miss expected: draft nothing ahead
            return None
        plan = self._plan(True, after=g + 1)
        if plan <= 0:
            return None
        seed, nxt = self.seed, self.round_idx + 1
        return await self.pro.speculate(
            self.c.scheduler.executor, list(tokens) + (list(block.tokens) if block else []),
            plan, self.cfg, lambda: rng.generator(seed, rng.DRAFT, nxt), verdict, early,
            len(tokens))

    def _send_ahead(self, block, pro: ProactiveResult | None,
                    verdict: asyncio.Future) -> Ahead | None:
        """Send the proactive chain's block now, if it is complete and the verdict it
        depends on is still pending (``send_ahead``). None when not sent."""
        if (not self.c.send_ahead or pro is None or len(pro.branches) != 1
                or verdict.done()):
            return None
        br = pro.branches[0]
        if (br.dead or len(br.tokens) != pro.plan or pro.plan <= 0
                or self.committer.eos.intersection((block.tokens if block else [])
                                                   + [br.root])):
            return None               # incomplete, or the request may end before it
        return self.sess.send_ahead(br.prefix, br.finish(pro.plan, self.cfg), pro.plan,
                                    br.root)


def check_acceptance(acceptance: str, cfg: SamplingConfig) -> None:
    """Raises ValueError unless ``acceptance`` is ``exact`` or ``semantic``, and
    ``semantic`` comes with a greedy config (WISV decides greedy blocks only)."""
    if acceptance not in ACCEPTANCE:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE}, not {acceptance!r}")
    if acceptance == "semantic" and not cfg.greedy:
        raise ValueError("acceptance='semantic' needs greedy sampling (temperature 0)")


def request_sampling(sampling) -> SamplingConfig:
    """A request's :class:`SamplingConfig` from ``sampling``: a config, a dict of its
    fields (``{"temperature": 0.7, "top_p": 0.9}``) or None (greedy).
    Raises ValueError naming the field (an unknown one, a bad value)."""
    if sampling is None:
        return SamplingConfig()
    if isinstance(sampling, SamplingConfig):
        return sampling
    if isinstance(sampling, dict):
        return SamplingConfig.from_dict(sampling)
    raise ValueError(f"sampling must be a SamplingConfig or a dict of its fields, not "
                     f"{type(sampling).__name__}")


def request_stop(stop) -> list[str]:
    """Stop strings: one string, a list or tuple of them (empty ones dropped), or None
    (none). Raises ValueError for anything else."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError("stop must be a string or a list of strings")
    return [s for s in stop if s]


def request_max_new_tokens(n) -> int:
    """Raises ValueError unless ``n`` is an int in ``1..MAX_NEW_TOKENS`` (a server caps
    prompt + new tokens further at its context)."""
    from edge_sdk.protocol.limits import MAX_NEW_TOKENS

    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be an integer in 1..{MAX_NEW_TOKENS}, "
                         f"not {n!r}")
    return n


def request_seed(seed) -> int:
    """The request's seed: ``seed`` (an int in ``0..2**63-1``), or a fresh random one
    when None, so sampled requests differ from call to call (as OpenAI's API and
    llama.cpp do); the result reports it (``GenerationResult.seed``) for a replay.
    Raises ValueError for anything else."""
    if seed is None:
        return rng.fresh_seed()
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed must be an integer in 0..2**63-1, not {seed!r}")
    return seed


def check_prompt(prompt, prompt_ids) -> None:
    """Raises ValueError unless exactly one of ``prompt`` (a non-blank string) and
    ``prompt_ids`` (a non-empty sequence of token ids) is given."""
    if (prompt is None) == (prompt_ids is None):
        raise ValueError("give exactly one of prompt or prompt_ids")
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        raise ValueError("prompt must be a non-empty string" if isinstance(prompt, str)
                         else f"prompt must be a string, not {type(prompt).__name__}")
    if prompt_ids is not None and len(prompt_ids) == 0:
        raise ValueError("prompt_ids must hold at least one token id")
