"""CATS: self-speculative decoding with a cascaded verification under a memory budget
(CATS: "cascaded verification and correction based on the memory budget and parameter
offloading patterns", its abstract; self-speculation by layer skipping from LayerSkip,
Elhoushi et al. 2024, §4; the draft's exit is the tuned lens, Belrose et al. 2023, §3;
siblings verified in the same pass: SpecInfer, Miao et al. 2024, §4).

The cascade, from cheapest to dearest, for one block of a round:

1. **Resident draft** (no storage reads), one of three (:mod:`.budget` picks by
   predicted rate): the early exit (layers ``0..E-1`` + the tuned exit head at ``E``,
   :class:`ExitDraft`), the layer-skipping draft (layers ``0..R1-1`` and a resident
   tail of ``R2`` more + the model's own head, :class:`~.skip.SkipDraft`, whose tail-layer entries
   are draft-only and cropped before step 3), or the quantized self-draft (every layer
   as 4-bit groups + the model's own head, :class:`~.quant.QuantDraft`, split 0: all
   its entries are draft-only and cropped before step 3). It proposes ``d_1..d_k``; its keys/values
   of layers ``0..S-1`` (``S`` = the split: ``E`` or ``R1``) are the target's own and
   are kept.
2. **Resident gate** (free): the draft's own probability of the block so far,
   ``prod_j q_j(d_j)``, is checked after each token; below the gate
   (:mod:`.budget`: ``t_draft / t_full``) the block stops: one more token would cost
   more drafting time than the streamed pass it can be expected to save.
3. **Full verification** (layers ``S..L-1``, the streamed ones included, ONE pass over
   the whole block: streamed bytes dominate and a pass costs the same for 1 or k+1
   tokens): runs on the stored residual streams of the draft at layer ``S`` (same
   position ids), so the skipped layers get their keys/values before anything uses
   them (CASES.md 11). The acceptance rule is the shared one
   (:mod:`edge_sdk.protocol.sampling`): greedy output is the target's token for token,
   sampling is exact (Leviathan et al. 2023, Alg. 1; residual draws local). Greedy
   blocks also carry siblings at the chain positions the draft is least sure of
   (:mod:`.siblings`).

After the verdict every layer's cache is cropped to the confirmed prefix minus its
last token (CASES.md 7). Draws: ``rng.LOCAL_DRAFT`` for the draft and
``rng.LOCAL_VERIFY`` for acceptance uniforms, residual and bonus, both indexed by the
block's position (confirmed length), so a block of zero drafts draws exactly what
target-alone sampling (:func:`decode_ar`) draws at that position.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from edge_sdk.exit_head import ExitHead
from edge_sdk.local_target.budget import MAX_DEPTH, NODES, QUANT_MAX_DEPTH
from edge_sdk.local_target.dyntree import greedy_path, rerank, rows_mask, top_children
from edge_sdk.local_target.runner import OffloadedTarget
from edge_sdk.local_target.siblings import (full_inputs, greedy_tree_verdict,
                                            resident_mask, tree_siblings)
from edge_sdk.protocol import rng
from edge_sdk.protocol import sampling as S

__all__ = ["LocalStats", "CatsDecoder", "ExitDraft", "decode_ar", "verify_block",
           "MAX_BLOCK"]

MAX_BLOCK = max(MAX_DEPTH, QUANT_MAX_DEPTH)
"""The deepest block any plan drafts (:mod:`.budget`)."""


@dataclass
class LocalStats:
    """Counters of one generation: rounds (full passes after the prefill), drafted and
    accepted draft tokens, committed tokens, seconds, storage bytes read."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    seconds: float = 0.0
    prefill_s: float = 0.0
    storage_bytes: int = 0
    sibling_hits: int = 0
    accepted_per_round: list = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "committed": self.committed, "seconds": self.seconds,
                "prefill_s": self.prefill_s,
                "storage_bytes": self.storage_bytes, "sibling_hits": self.sibling_hits,
                "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.committed / max(1, self.rounds),
                "throughput_tok_s": self.committed / self.seconds if self.seconds else 0.0}


def verify_block(logits: torch.Tensor, context: list[int], block: list[int],
                 qs: list, cfg: S.SamplingConfig, gen: torch.Generator) -> tuple[int, int]:
    """The acceptance rule over one block (the cloud verifier's, standard mode).

    Args: logits float32 [g+1, V] after ``context + block[:i]``; qs: the draft's
    processed distributions float64 [V] per draft (None when greedy).
    Returns ``(accepted drafts, next token)`` (correction or bonus)."""
    g = len(block)
    x = S.process_block(logits, cfg, context, block)
    if cfg.greedy:
        return S.greedy_verify(torch.tensor(block, dtype=torch.long), x)
    p = torch.softmax(x, dim=-1)
    q_tok = torch.stack([q[t] for q, t in zip(qs, block)]) if g else None
    a = S.sampled_accepts(p, block, q_tok, gen)
    if a == g:
        return a, S.sample_next(logits[g], cfg, context + block, gen)[0]
    return a, int(S.sample(S.residual(p[a], qs[a]), gen))


def _prefill(t: OffloadedTarget, prompt: list[int]) -> None:
    """Reset the cache and fill it with ``prompt[:-1]`` (no logits needed)."""
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    t.reset()
    if len(prompt) > 1:
        t.run_layers(t.embed(prompt[:-1]), 0, t.num_layers)


def _finish(ids: list[int], n0: int, new: list[int], eos: set, cap: int) -> bool:
    """Append ``new`` to ``ids`` up to an EOS or the cap; True when generation ends."""
    for tok in new:
        ids.append(tok)
        if tok in eos or len(ids) - n0 >= cap:
            return True
    return False


def decode_ar(t: OffloadedTarget, prompt: list[int], max_new_tokens: int,
              cfg: S.SamplingConfig, seed: int = 0, eos=()) -> tuple[list[int], LocalStats]:
    """The target alone, one full (streamed) pass per token: the baseline
    (``local-offload-ar``). Returns ``(generated ids, stats)``."""
    t0, b0 = time.perf_counter(), t.storage.stats.bytes_read
    ids, st, eos = list(prompt), LocalStats(), set(eos)
    _prefill(t, ids)
    st.prefill_s = time.perf_counter() - t0
    done = max_new_tokens <= 0
    while not done:
        lg = t.forward([ids[-1]])[0]
        gen = rng.generator(seed, rng.LOCAL_VERIFY, len(ids))
        tok = S.sample_next(lg, cfg, ids, gen)[0]
        st.rounds += 1
        done = _finish(ids, len(prompt), [tok], eos, max_new_tokens)
    st.committed = len(ids) - len(prompt)
    st.seconds, st.storage_bytes = time.perf_counter() - t0, t.storage.stats.bytes_read - b0
    return ids[len(prompt):], st


class ExitDraft:
    """The early-exit draft: layers ``0..E-1`` + the exit head at ``E = head.layer``
    (all of them the target's leading resident layers). ``split`` = E; nothing of its
    cache is draft-only. Raises ValueError when the exit layer is not resident."""

    def __init__(self, target: OffloadedTarget, head: ExitHead):
        if head.layer > target.R1 or head.layer >= target.num_layers:
            raise ValueError(f"exit layer {head.layer} is not resident (R={target.R1})")
        self.t, self.head, self.split, self.name = target, head, head.layer, head.name

    def step(self, tok: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``tok`` through layers ``0..E-1``: the residual stream at ``E`` [1, 1, H]
        and the exit logits float32 [V]."""
        h = self.t.run_layers(self.t.embed([tok]), 0, self.split)
        return h, self.head.logits(h[0])[0]

    def step_rows(self, toks: list[int], pos: torch.Tensor, mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tree rows ``toks`` [q] at positions ``pos`` long [1, q] under ``mask`` bool
        [1, 1, q, cached + q]: residual streams at E [1, q, H], exit logits float32
        [q, V]."""
        h = self.t.run_layers(self.t.embed(toks), 0, self.split, pos, mask)
        return h, self.head.logits(h[0])

    def release(self, n: int) -> None:
        """Nothing draft-only to drop."""


class CatsDecoder:
    """Self-speculative cascaded decoding on an :class:`OffloadedTarget`.

    Args:
        target: the budgeted target. head: the exit head at layer ``E = head.layer``
            (E <= leading resident layers: drafting reads nothing from storage), or a
            draft object with ``split``, ``step`` and ``release``
            (:class:`ExitDraft`, :class:`~.skip.SkipDraft`, :class:`~.quant.QuantDraft`).
        depth: the most draft tokens per block (1.. :data:`MAX_BLOCK`). gate: the cascade's gate on the
            block's draft probability (0: off). width: 1 + the number of sibling
            candidates in the block, at the chain positions the draft is least sure
            to reach past (greedy, :mod:`.siblings`; 1: a chain). siblings: the
            policy ``(draft logits [g] of [V], drafts [g], m) -> alts [g]`` that places
            the ``width - 1`` siblings (:func:`~.siblings.tree_siblings`; any choice
            keeps the output exact).
        beam: greedy blocks as a dynamic draft tree (:mod:`.dyntree`, EAGLE-2) that
            expands the ``beam`` most confident nodes of each depth with their
            ``beam`` most likely children, up to ``depth`` levels (1: a chain, with
            siblings by ``width``). nodes: the most tree nodes the full pass verifies
            (the root, the context's last token, is one more row).
    Raises:
        ValueError: the exit layer is not resident or depth is outside 1..MAX_BLOCK.
    """

    def __init__(self, target: OffloadedTarget, head, depth: int,
                 gate: float = 0.0, width: int = 1, siblings=tree_siblings,
                 beam: int = 1, nodes: int = NODES):
        draft = ExitDraft(target, head) if isinstance(head, ExitHead) else head
        if not 1 <= depth <= MAX_BLOCK:
            raise ValueError(f"depth {depth} outside 1..{MAX_BLOCK}")
        self.t, self.draft, self.depth, self.gate = target, draft, int(depth), float(gate)
        self.E, self.width, self.sibling_hits = draft.split, max(1, int(width)), 0
        self.siblings = siblings
        self.beam, self.nodes = max(1, int(beam)), max(1, int(nodes))

    def _draft(self, ids: list[int], k: int, cfg, seed: int):
        """Up to ``k`` draft tokens from the resident layers (stage 1-2). Returns
        ``(drafts, qs, residual streams at the split S of [ids[-1], d_1..d_{g-1}], the
        draft logits float32 [V] after ids[-1], d_1, .., d_{g-1})``; draft-only cache
        entries are dropped."""
        drafts, qs, hs, x, mass, lgs = [], [], [], ids[-1], 1.0, []
        for j in range(k):
            h, lg = self.draft.step(x)
            hs.append(h)
            lgs.append(lg)
            gen = rng.generator(seed, rng.LOCAL_DRAFT, len(ids) + j)
            tok, q = S.sample_next(lg, cfg, ids + drafts, gen)
            drafts.append(tok)
            qs.append(q)
            x = tok
            mass *= float(q[tok]) if q is not None else float(torch.softmax(lg, -1).max())
            if mass < self.gate:
                break
        self.draft.release(len(ids) - 1)
        return drafts, qs, hs, lgs

    def round(self, ids: list[int], k: int, cfg, seed: int) -> tuple[list[int], int, int]:
        """One round: draft, one verification pass, the verdict; the caches end at the
        confirmed prefix minus its last token. Returns ``(new tokens, drafted,
        accepted)``."""
        if self.beam > 1 and k and cfg.greedy and cfg.repetition_penalty == 1.0:
            return self._dyn_round(ids, k)
        drafts, qs, hs, lgs = self._draft(ids, k, cfg, seed) if k else ([], [], [], [])
        last = drafts[-1] if drafts else ids[-1]
        hs.append(self.t.run_layers(self.t.embed([last]), 0, self.E))
        if (self.width > 1 and drafts and cfg.greedy and cfg.repetition_penalty == 1.0):
            alts = self.siblings(lgs, drafts, self.width - 1)
            if any(alts):
                return self._tree_round(ids, drafts, hs, alts)
        h = self.t.run_layers(torch.cat(hs, 1), self.E, self.t.num_layers)
        logits = self.t.logits(h)                                      # [g+1, V]
        gen = rng.generator(seed, rng.LOCAL_VERIFY, len(ids))
        a, nxt = verify_block(logits, ids, drafts, qs, cfg, gen)
        self.t.crop(len(ids) + a)
        return drafts[:a] + [nxt], len(drafts), a

    def _tree_round(self, ids: list[int], drafts: list[int], hs: list,
                    alts: list[list[int]]):
        """The greedy round with siblings ``alts`` [k] per chain position
        (:mod:`.siblings`): their resident pass, one full pass over chain + siblings,
        the verdict, the cache cut to the accepted branch. Returns ``(new tokens,
        drafted, accepted)``."""
        P, k = len(ids) - 1, len(drafts)
        pos, mask, tree = full_inputs(P, drafts, alts)
        sibs = [tok for _, tok, _ in tree.sib_rows]
        rpos, rmask = resident_mask(P, k, [i for i, _, _ in tree.sib_rows])
        hs.append(self.t.run_layers(self.t.embed(sibs), 0, self.E, rpos, rmask))
        h = self.t.run_layers(torch.cat(hs, 1), self.E, self.t.num_layers, pos, mask)
        new, a, j = greedy_tree_verdict(self.t.logits(h), drafts, tree)
        if j is None:
            self.t.crop(P + 1 + a)
        else:                               # prefix, last, d_1..d_a, then the sibling
            self.t.keep(P + 1 + a, [P + 1 + k + j])
            self.sibling_hits += 1
        return new, k, a

    def _dyn_round(self, ids: list[int], k: int) -> tuple[list[int], int, int]:
        """The greedy round over a dynamic draft tree of at most ``k`` levels
        (:mod:`.dyntree`): one resident pass per level over the expanded nodes, one
        over the selected nodes never expanded (layers below the split only), the
        caches below the split reordered to the pass rows ``[root, selected]``, ONE
        full pass, the verdict, every cache cut to the accepted path. Returns ``(new
        tokens, tree depth, accepted nodes)``; accepted nodes that are not their
        parent's most likely child count as :attr:`sibling_hits`."""
        t, d, P = self.t, self.draft, len(ids) - 1
        toks, par, dep, sc, rank = [], [], [], [], []
        h_of: dict[int, torch.Tensor] = {}

        def grow(parent: int, logits: torch.Tensor, base: float, depth: int) -> None:
            for r, (tok, p) in enumerate(top_children(logits, self.beam)):
                toks.append(tok), par.append(parent), dep.append(depth)
                sc.append(base * p), rank.append(r)

        h0, lg0 = d.step(ids[-1])                       # the root, at position P
        h_of[-1], cached = h0[0, 0], [-1]
        grow(-1, lg0, 1.0, 1)
        level = list(range(len(toks)))
        for depth in range(2, k + 1):
            expand = sorted(level, key=lambda n: -sc[n])[: self.beam]
            if not expand or sc[expand[0]] < self.gate:
                break
            pos = torch.tensor([[P + dep[n] for n in expand]], dtype=torch.long)
            h, lg = d.step_rows([toks[n] for n in expand], pos,
                                rows_mask(par, expand, cached, P))
            cached += expand
            start = len(toks)
            for r, n in enumerate(expand):
                h_of[n] = h[0, r]
                grow(n, lg[r], sc[n], depth)
            level = list(range(start, len(toks)))
        sel = rerank(sc, dep, self.nodes)
        extra = [n for n in sel if n not in h_of]
        if extra:                              # below the split only: no draft logits
            pos = torch.tensor([[P + dep[n] for n in extra]], dtype=torch.long)
            hx = t.run_layers(t.embed([toks[n] for n in extra]), 0, self.E, pos,
                              rows_mask(par, extra, cached, P))
            for r, n in enumerate(extra):
                h_of[n] = hx[0, r]
            cached += extra
        d.release(P)                           # draft-only tail entries
        at = {n: P + j for j, n in enumerate(cached)}
        t.keep(P, [at[n] for n in [-1] + sel], range(self.E))
        T = 1 + len(sel)
        pos = torch.tensor([[P] + [P + dep[n] for n in sel]], dtype=torch.long)
        mask = torch.zeros(1, 1, T, P + T, dtype=torch.bool)
        mask[0, 0, 0, : P + 1] = True
        mask[0, 0, 1:] = rows_mask(par, sel, [-1], P)[0, 0]
        x = torch.stack([h_of[n] for n in [-1] + sel])[None]
        h = t.run_layers(x, self.E, t.num_layers, pos, mask)
        path, nxt = greedy_path(t.greedy(h), toks, par, sel)
        t.keep(P + 1, [P + r for r in path])
        self.sibling_hits += sum(rank[sel[r - 1]] > 0 for r in path)
        return [toks[sel[r - 1]] for r in path] + [nxt], max(dep[n] for n in sel), len(path)

    def generate(self, prompt: list[int], max_new_tokens: int, cfg: S.SamplingConfig,
                 seed: int = 0, eos=()) -> tuple[list[int], LocalStats]:
        """Generate up to ``max_new_tokens`` after ``prompt`` (stops at an EOS id).
        Returns ``(generated ids, stats)``."""
        t0, b0 = time.perf_counter(), self.t.storage.stats.bytes_read
        ids, st, eos, h0 = list(prompt), LocalStats(), set(eos), self.sibling_hits
        _prefill(self.t, ids)
        st.prefill_s = time.perf_counter() - t0
        done = max_new_tokens <= 0
        while not done:
            k = min(self.depth, max_new_tokens - (len(ids) - len(prompt)) - 1)
            new, g, a = self.round(ids, k, cfg, seed)
            st.rounds, st.drafted, st.accepted = st.rounds + 1, st.drafted + g, st.accepted + a
            st.accepted_per_round.append(a)
            done = _finish(ids, len(prompt), new, eos, max_new_tokens)
            self.t.crop(len(ids) - 1)
        st.committed = len(ids) - len(prompt)
        st.seconds = time.perf_counter() - t0
        st.storage_bytes = self.t.storage.stats.bytes_read - b0
        st.sibling_hits = self.sibling_hits - h0
        return ids[len(prompt):], st
