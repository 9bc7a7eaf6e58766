"""IPDG / NPDG — proactive draft generation while a block is being verified
(RAPID).

While block ``D_i`` is in flight the edge drafts ``D_{i+1}`` from the *assumed* prefix
(``D_i`` fully accepted + a guessed bonus token). The guess is the draft's top-b tokens
after the last draft (b = 1: a chain; b > 1: a small tree with b roots).

IPDG (interruptible), per RAPID's boundary protocol:

1. *Save the boundary*: the confirmed prefix (``tokens``) and the in-flight block are
   the boundary; the draft caches only ever grow past it, and ``Drafter.sync`` rolls a
   cache back to the longest common prefix with any later context.
2. *Expand once*: one complete expansion step = one draft token on every live branch
   (:meth:`Branch.expand`, run on the draft worker thread, off the event loop).
3. *Check feedback* (non-blocking) after every step: once the verdict is in, start no
   further step.
4. *Reconcile*: a **hit** (all of ``D_i`` accepted and the bonus equals a root) keeps
   that branch, drops the others and continues it to the planned depth; a **miss**
   drops every branch and the next block is drafted from the true prefix (the next
   ``sync`` truncates the KV cache back to the common prefix).

Tree KV choice: each root gets its own drafter fork (``Drafter.fork``: shared weights,
own KV cache), so branch k extends its own cache without disturbing the others. On a
hit the kept branch's fork simply becomes the request's drafter (the "remap" is an
ownership swap, zero copy); the other forks are not copied or remapped: their next
``sync`` rolls them back by longest common prefix and re-runs what is missing in one
batched forward. Drafters that cannot fork share one cache; branches then re-run their
tokens on every switch (correct, slower).

A branch is a hit only if the whole block in flight is accepted, so IPDG may also skip
the branch of a block it expects to lose (``min_hit``): :func:`hit_chance` predicts
that from the draft's own probabilities of the block's tokens (the same signal by which
EAGLE-2, Li et al. 2024, §4, and SpecDec++, Huang et al. 2024, decide where a draft
stops being worth verifying). A skipped branch costs a hit's head start only; the edge
drafts nothing a miss would discard.

NPDG (non-interruptible baseline): runs to the planned depth whatever the feedback,
then keeps (hit) or discards (miss); it never skips.

FSD (the FSD review, §III): the cloud streams an *early verdict* (accepted drafts and
the next token, read at an early exit of the target) before the final one. On it the
edge keeps the branch whose prefix is the provisional prefix (confirmed + accepted
drafts + provisional next token) and drops the others, or, when no branch has that
prefix (a block predicted to be rejected mid-way, or a bonus IPDG did not guess),
starts a branch from it beside IPDG's (an early exit is a weaker predictor than its
name suggests: it does not overrule the draft's guess). ``fsd`` drafts only from
early verdicts; ``fsd+ipdg`` starts with IPDG's guesses. A branch is kept only if its
prefix is the *final* confirmed prefix, so the early verdict never decides anything:
a wrong one only wastes draft work.

Exactness: every branch samples through ``Drafter.propose`` (the shared processors)
with the generator of the round it would be drafted in (``edge_sdk.protocol.rng``,
stream ``DRAFT``), so
on a hit its tokens are exactly those a stop-and-wait client would have drafted from the
same (true) prefix with the same seed; on a miss its draws are discarded, and fresh,
independent ones are used. The verifier and its acceptance rule never change.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from edge_sdk.drafters.base import DraftBlock, Drafter
from edge_sdk.protocol.sampling import SamplingConfig, process_next

MODES = ("off", "ipdg", "npdg", "fsd", "fsd+ipdg")
EARLY_MODES = ("fsd", "fsd+ipdg")
"""Proactive modes that ask the cloud for early verdicts."""
SKIPPING_MODES = ("ipdg",)
"""Proactive modes that skip the branch of a block predicted to miss (``min_hit``; the
FSD modes keep drafting from the early verdict instead)."""


def hit_chance(block: DraftBlock) -> float:
    """The draft's own estimate that the target accepts every token of ``block``: the
    product over its g positions of the draft probability of the drafted token
    (greedy: ``conf``, the softmax probability of the argmax; sampled: ``q_tok``,
    ``q_i(d_i)``, a proxy for ``min(1, p_i(d_i) / q_i(d_i))``). 1.0 for an empty block
    and for greedy drafts without probabilities (``conf`` None, ``q_tok`` 1.0: n-gram
    lookups), which are never skipped. Returns a float in [0, 1]."""
    probs = block.conf if block.conf is not None else block.q_tok.tolist()
    return math.prod(min(1.0, max(0.0, float(p))) for p in probs)


def guess_roots(drafter: Drafter, assumed: Sequence[int], cfg: SamplingConfig,
                b: int) -> list[int]:
    """The draft's top-``b`` guesses for the token after ``assumed`` (one draft forward;
    processed logits, ties to the lower id). Empty when the drafter has no proposal
    (n-gram lookup without a match)."""
    logits = drafter.sync(list(assumed))
    if not getattr(drafter, "matched", True):
        return []
    x = process_next(logits, cfg, assumed)
    return [int(t) for t in top_ids(x, b) if torch.isfinite(x[t])]


def top_ids(x: torch.Tensor, b: int) -> torch.Tensor:
    """Ids of the ``b`` largest entries of ``x`` [V], largest first, ties to the lower id:
    the first ``b`` of a stable descending sort, without sorting all V entries (a full
    sort of a 151,936-token vocabulary per proactive phase showed in the edge's
    profile). Long [min(b, V)]."""
    b = min(int(b), x.numel())
    if b == 1:
        return torch.argmax(x).reshape(1)       # the first maximal entry
    cand = torch.nonzero(x >= torch.topk(x, b).values[-1]).flatten()   # ascending ids
    return cand[torch.argsort(-x[cand], stable=True)][:b]


@dataclass
class Branch:
    """One proactive branch: ``root`` then drafted tokens, with their q (AsymSpec §IV-B wire
    values) and the round generator it samples from."""

    drafter: Drafter
    prefix: list[int]            # assumed prefix, root included
    gen: torch.Generator
    root: int
    tokens: list[int] = field(default_factory=list)
    q_tok: list[float] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)
    draft_s: float = 0.0         # seconds of expansion steps that built it
    dead: bool = False           # no further proposal (n-gram without a match)
    cands: list | None = field(default_factory=list)    # greedy sibling candidates
    conf: list = field(default_factory=list)

    def _take(self, blk: DraftBlock) -> None:
        self.tokens += blk.tokens
        self.q_tok += [float(x) for x in blk.q_tok]
        if blk.q is not None:
            self.q_rows += list(blk.q)
        if blk.cands is None or self.cands is None:
            self.cands = None
        else:
            self.cands += blk.cands
            self.conf += blk.conf
        if len(blk) == 0:
            self.dead = True

    def expand(self, cfg: SamplingConfig) -> None:
        """Draft one more token (one draft forward)."""
        if not self.dead:
            self._take(self.drafter.propose(self.prefix + self.tokens, 1, cfg, self.gen))

    def finish(self, depth: int, cfg: SamplingConfig) -> DraftBlock:
        """Continue to ``depth`` tokens (one ``propose`` call: same draws as drafting
        them in one go) and return the block."""
        t0 = time.perf_counter()
        if len(self.tokens) > depth:
            del self.tokens[depth:], self.q_tok[depth:], self.q_rows[depth:]
            if self.cands is not None:
                del self.cands[depth:], self.conf[depth:]
        elif len(self.tokens) < depth and not self.dead:
            self._take(self.drafter.propose(self.prefix + self.tokens,
                                            depth - len(self.tokens), cfg, self.gen))
        self.draft_s += time.perf_counter() - t0
        q = torch.stack(self.q_rows) if (self.q_rows and not cfg.greedy) else (
            None if cfg.greedy else torch.zeros(0, self.drafter.vocab_size,
                                                dtype=torch.float64))
        whole = self.cands is not None and len(self.cands) == len(self.tokens)
        return DraftBlock(list(self.tokens), torch.tensor(self.q_tok, dtype=torch.float64),
                          q, self.draft_s, list(self.cands) if whole else None,
                          list(self.conf) if whole else None)


@dataclass
class ProactiveResult:
    """Outcome of one proactive phase (per round; reported through the request's ``on_round`` hook)."""

    branches: list[Branch]
    plan: int                    # planned depth of the next block
    steps: int = 0               # complete expansion steps run
    late_steps: int = 0          # steps started after the verdict had arrived (NPDG)
    t_ready: float | None = None     # perf_counter when expansion stopped
    step_s: float = 0.0          # seconds in expansion steps (roots forward included)
    early: object = None         # the EarlyVerdict applied (FSD), or None
    t_early: float | None = None     # perf_counter when it was applied
    redirected: bool = False     # ... and it started a branch of its own
    discarded: int = 0           # tokens of branches the early verdict dropped

    @property
    def roots(self) -> list[int]:
        return [b.root for b in self.branches]

    def drafted(self) -> int:
        return sum(len(b.tokens) for b in self.branches) + self.discarded

    def settle(self, confirmed: Sequence[int] | None) -> tuple[Branch | None, int]:
        """Keep the branch whose prefix is the ``confirmed`` prefix after the verdict
        (None: nothing can match). Returns ``(kept branch or None, discarded draft
        tokens)``."""
        kept = (None if confirmed is None else
                next((b for b in self.branches if b.prefix == list(confirmed)), None))
        return kept, self.drafted() - (len(kept.tokens) if kept else 0)

    def step(self, cfg: SamplingConfig) -> float:
        """One expansion step: one draft token on every live branch short of the plan
        (draft worker thread). Returns its seconds, charged to each grown branch."""
        s0 = time.perf_counter()
        grow = [br for br in self.branches if not br.dead and len(br.tokens) < self.plan]
        for br in grow:
            br.expand(cfg)
        dt = time.perf_counter() - s0
        for br in grow:
            br.draft_s += dt
        return dt

    def apply_early(self, ev, assumed: Sequence[int], base_len: int,
                    drafters: Sequence[Drafter], gen: torch.Generator) -> None:
        """FSD: steer the branches by early verdict ``ev`` (``assumed[:base_len]``
        confirmed, ``assumed[base_len:]`` the block in flight). A branch on the
        provisional prefix is kept alone (the draft's guess and the target's early
        exit agree); otherwise a branch on the provisional prefix starts beside the
        others (roots = the early-exit token + the draft's guesses), on a drafter no
        kept branch uses, with ``gen``. A sampled rejection (no next token) changes
        nothing (its correction is drawn on the edge from the final distribution)."""
        self.early, self.t_early = ev, time.perf_counter()
        g = len(assumed) - base_len
        if ev.next_token is None or ev.accepted > g:
            return
        prov = list(assumed[:base_len + ev.accepted]) + [int(ev.next_token)]
        match = [b for b in self.branches if b.prefix == prov]
        if match:
            self.discarded += sum(len(b.tokens) for b in self.branches if b not in match)
            self.branches = match
            return
        busy = {id(b.drafter) for b in self.branches}
        free = next((d for d in drafters if id(d) not in busy), drafters[0])
        self.branches.append(Branch(free, prov, gen, prov[-1]))
        self.redirected = True


async def run_proactive(drafters: Sequence[Drafter], executor, assumed: list[int],
                        plan: int, cfg: SamplingConfig, gen_factory, b: int,
                        verdict: asyncio.Future, interruptible: bool,
                        early: asyncio.Future | None = None, base_len: int | None = None,
                        guess: bool = True) -> ProactiveResult | None:
    """Draft the next block from ``assumed`` while ``verdict`` is pending.

    Args:
        drafters: one drafter per root (forks; ``drafters[0]`` guesses the roots).
        executor: the draft worker (forwards run there, off the event loop).
        assumed: confirmed prefix + the block in flight (its first ``base_len`` ids
            are confirmed).
        plan: planned depth (tokens) of the next block.
        gen_factory: ``() -> torch.Generator`` for the next round's draws (one per branch).
        b: number of roots (1: chain). verdict: the in-flight block's response task.
        interruptible: IPDG (stop at the first check after the verdict) or NPDG.
        early: FSD: resolves to the block's EarlyVerdict (never if the cloud sends none).
        guess: start from IPDG's guessed roots (False: only from ``early``).
    Returns None when no branch could be started.
    """
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    res = ProactiveResult([], plan)
    if guess:
        roots = await loop.run_in_executor(executor, guess_roots, drafters[0], assumed,
                                           cfg, b)
        res.branches = [Branch(drafters[i % b], list(assumed) + [r], gen_factory(), r)
                        for i, r in enumerate(roots)]
    if not res.branches and early is None:
        return None
    while True:
        if (early is not None and res.early is None and early.done()
                and not verdict.done()):
            res.apply_early(early.result(), assumed, len(assumed) if base_len is None
                            else base_len, drafters, gen_factory())
        if not any(not br.dead and len(br.tokens) < plan for br in res.branches):
            if verdict.done() or early is None or res.early is not None:
                break
            await asyncio.wait({verdict, early}, return_when=asyncio.FIRST_COMPLETED)
            continue                     # an early verdict, or the final one
        if verdict.done():
            if interruptible:
                break                    # mismatch or not: the gate closes; reconcile
            res.late_steps += 1
        await loop.run_in_executor(executor, res.step, cfg)
        res.steps += 1
    res.t_ready = time.perf_counter()
    res.step_s = res.t_ready - t0
    return None if not (res.branches or res.early or guess) else res


class Lookahead:
    """One request's proactive drafting around its round loop.

    Holds the request's current ``drafter`` (a hit makes the kept branch's fork the
    request's drafter: the KV "remap" is an ownership swap), the ``forks`` for tree
    roots (b > 1), and ``kept``: the branch kept from the last hit with its planned
    depth, continued by the next round.
    """

    def __init__(self, drafter: Drafter | None, mode: str, roots: int):
        self.drafter, self.mode, self.roots = drafter, mode, roots
        self.forks: list[Drafter] = []
        self.kept: tuple[Branch, int] | None = None

    def take_kept(self) -> tuple[Branch, int] | None:
        """The branch kept from the last round's hit (and its plan), now consumed."""
        kept, self.kept = self.kept, None
        return kept

    async def speculate(self, executor, assumed: list[int], plan: int, cfg: SamplingConfig,
                        gen_factory, verdict: asyncio.Future,
                        early: asyncio.Future | None = None,
                        base_len: int | None = None) -> ProactiveResult | None:
        """:func:`run_proactive` on the request's drafters (forks made as needed).
        Best effort: a failure drops the branch (None; the verdict is still used)."""
        b = self.roots if self.mode != "fsd" else 1
        n = b + (self.mode == "fsd+ipdg")          # + a drafter for the early branch
        while len(self.forks) < n - 1:
            self.forks.append(self.drafter.fork())
        try:
            return await run_proactive([self.drafter] + self.forks[:n - 1], executor,
                                       assumed, plan, cfg, gen_factory, b, verdict,
                                       interruptible=self.mode != "npdg", early=early,
                                       base_len=base_len, guess=self.mode != "fsd")
        except Exception:  # noqa: BLE001 - proactive drafting is an optimisation only
            return None

    def settle(self, pro: ProactiveResult | None, confirmed: Sequence[int] | None,
               done: bool, m) -> int:
        """Reconcile the proactive phase with the verdict; returns discarded tokens.

        ``confirmed``: the confirmed prefix after the verdict; the branch drafted on
        exactly that prefix is kept (none: a miss, every branch is dropped and the next
        ``sync`` rolls the caches back). A kept branch is discarded too when the
        request is ``done``. ``m``: the request's RequestMetrics (proactive counters)."""
        if pro is None:
            return 0
        m.proactive_rounds += 1
        m.proactive_drafted_tokens += pro.drafted()
        m.proactive_late_steps += pro.late_steps
        kept, dropped = pro.settle(confirmed)
        if pro.early is not None:
            m.early_redirects += pro.redirected
            m.early_redirect_hits += kept is not None and pro.redirected
        m.proactive_wasted_tokens += dropped
        if kept is not None and not done:
            m.proactive_hits += 1
            if kept.drafter is not self.drafter:
                i = self.forks.index(kept.drafter)
                self.forks[i], self.drafter = self.drafter, kept.drafter
            self.kept = (kept, pro.plan)
        elif kept is not None:
            m.proactive_wasted_tokens += len(kept.tokens)
            dropped += len(kept.tokens)
        return dropped
