"""Target-side verification of draft blocks and the correction payloads
(speculative sampling, Leviathan et al. 2023 §2.3; AsymSpec §IV-B), and WISV's opt-in
semantic acceptance for sessions that ask for it (WISV §III).

Mechanism only: the acceptance rule, residual and certificate math come from
``edge_sdk.protocol.sampling`` (shared with the edge); whether a mismatching draft is
accepted semantically is the policy of :class:`cloud_api.wisv.serving.SemanticAcceptance`.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from cloud_api.early_exit import ExitHead, decoder_layers
from cloud_api.early_verdict import provisional_verdict
from cloud_api.sessions import ApiError, Session
from cloud_api.wisv.serving import SemanticAcceptance
from edge_sdk.invariant import make_row_invariant
from edge_sdk.kvmodel import batched_forward
from edge_sdk.models import free_pass_rows
from edge_sdk.protocol import rng
from edge_sdk.protocol import sampling as S
from edge_sdk.protocol import tree as TR
from edge_sdk.protocol.frames import EarlyVerdict
from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS
from edge_sdk.protocol.wire import (Correction, CorrectionRequest, CorrectionResponse,
                                    VerifyRequest, VerifyResponse)

log = logging.getLogger("cloud_api")


def _q_tok(s: Session, req: VerifyRequest, block: list[int]) -> torch.Tensor:
    """float64 [g]: the draft's probability of each block token (the standard
    protocol's full rows, or the compact protocol's uploaded values)."""
    if s.mode == "standard":
        return torch.tensor(np.asarray(req.q_full)[np.arange(len(block)), block])
    return torch.tensor(np.array(req.q_tok, dtype=np.float64))


ROW_INVARIANT_MODES = ("exact", "fast", "off")


class Verifier:
    """Verifies blocks against the target model.

    ``verify_batch`` takes a list of (session, request) pairs (a batching front end
    hands over whatever has arrived) and runs them in one target pass (the sessions' rows
    packed, each attending to its own KV cache: :mod:`edge_sdk.row_attention`); each pair
    is answered on its own. ``passes`` counts target passes (a batch counts once).

    With an ``early_head`` (FSD), a block whose caller passed a sink gets a provisional
    :class:`~edge_sdk.protocol.frames.EarlyVerdict` from the exit layer *during* the pass
    (a forward hook on that decoder layer: same pass, same positions and caches; the
    layers above still run in full); ``early_frames`` / ``early_hits`` count them and
    how many matched the final verdict.

    A greedy block may carry siblings (``VerifyRequest.alts``): its rows form a sibling
    tree (:mod:`edge_sdk.protocol.tree`) run in the same pass under a tree mask, at most
    ``max_tree_rows`` rows; ``sibling_hits`` counts the accepted siblings. ``free_rows``
    (advertised to clients) is how many rows a pass holds at about the cost of one
    (:func:`edge_sdk.models.free_pass_rows` unless given; at most ``max_tree_rows``):
    the SDK's default tree stays within it.

    With ``semantic`` (WISV §III), sessions created with ``acceptance="semantic"`` may
    have mismatching drafts accepted by its decision head (:meth:`_semantic_walk`): a
    forward pre-hook on the LM head keeps the target's last hidden state [1, sum T_b, H]
    (rows packed) of a pass that holds such a row (registered for that pass only); ``semantic_accepted``
    counts the tokens accepted that way. Exact sessions are decided by the exact rule
    alone, whatever ``semantic`` is.

    ``row_invariant`` makes the target's verify passes row-invariant
    (:func:`edge_sdk.invariant.make_row_invariant`, in place): a row's logits are bit for
    bit those of the target decoding alone, so greedy output is the target's even at
    near-ties in bf16. ``"exact"`` (default): every verify pass, batched passes of more
    rows than the kernels keep alike run their linears in pieces (8 sessions x 5 tokens
    609-638 ms against 505-749, x 9 1.02 s against 0.57-0.79 s); ``"fast"``: no pieces,
    such large batched passes follow the near-tie policy; ``"off"``: the model's own
    kernels; None: ``$SPECRELAY_ROW_INVARIANT`` or ``"exact"``. A single session's
    9-token pass costs ~1-3 % more, a 16-row one (chain or sibling tree) ~7-9 % more:
    its per-token attention calls (``python -m bench.probes.tree_cost``).
    """

    supports_trees = True

    def __init__(self, model, max_block: int = MAX_DRAFT_TOKENS,
                 early_head: ExitHead | None = None,
                 semantic: SemanticAcceptance | None = None, max_tree_rows: int = 40,
                 free_rows: int | None = None, row_invariant: str | None = None):
        if row_invariant is None:
            row_invariant = os.environ.get("SPECRELAY_ROW_INVARIANT", "exact")
        if row_invariant not in ROW_INVARIANT_MODES:
            raise ValueError(f"row_invariant={row_invariant!r}: expected one of "
                             f"{', '.join(ROW_INVARIANT_MODES)}")
        if row_invariant != "off":
            make_row_invariant(model, pieces=row_invariant == "exact")
        self.row_invariant = row_invariant
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.max_context = int(getattr(model.config, "max_position_embeddings", 8192))
        self.max_block = max_block
        self.passes = 0
        self.target_seconds = 0.0
        self.near_tie_gap = S.near_tie_gap(next(model.parameters()).dtype)
        self.near_ties = 0          # committed greedy tokens chosen at a near-tie
        self.max_tree_rows = max_tree_rows
        if free_rows is None:
            free_rows = free_pass_rows(model)
        if int(free_rows) < 0:
            raise ValueError("free_rows must be >= 0")
        self.free_rows = min(int(free_rows), max_tree_rows)
        self.sibling_hits = 0
        self.early_head = early_head
        self.early_frames = self.early_hits = 0
        self.on_early_outcome = None    # (hit: bool) -> None, e.g. a Prometheus counter
        self._early = None          # (pass start, rows wanting an early verdict)
        self._provisional: dict[int, tuple] = {}    # id(request) -> (accepted, next)
        if early_head is not None:
            decoder_layers(model)[early_head.layer - 1].register_forward_hook(
                self._exit_hook)
        self.semantic = semantic
        self.semantic_accepted = 0      # tokens accepted semantically (WISV)
        self._hidden: torch.Tensor | None = None    # [1, sum T_b, H] of a semantic pass
        if semantic is not None:
            hid = int(model.config.hidden_size)
            if semantic.hidden_size != hid:
                raise ValueError(f"WISV head: hidden size {semantic.hidden_size} != the "
                                 f"target's {hid}")

    def prefill(self, s: Session) -> float:
        """Fill the target cache with the prompt minus its last token. Returns seconds."""
        t0 = time.perf_counter()
        if len(s.tokens) > 1:
            s.kv.crop(0)
            s.kv.forward(s.tokens[:-1], last=1)     # no logits are read: skip the head
        return time.perf_counter() - t0

    def verify_batch(self, items: list[tuple[Session, VerifyRequest]], sinks=None):
        """Verify blocks of different sessions in ONE batched target pass (rows packed,
        each attending to its own KV cache). Returns one VerifyResponse or
        ApiError per item, in order; each session ends at its own confirmed prefix.
        ``sinks``: per item a callable taking the block's EarlyVerdict (called on the
        target thread, mid-pass), or None."""
        self._provisional.clear()
        results, ready = self.ready_blocks(items)
        if len({id(s) for _, s, *_ in ready}) != len(ready):
            raise AssertionError("two blocks of one session in a batch")
        if not ready:
            return results
        t0 = time.perf_counter()
        for _, s, _, context, _ in ready:
            s.kv.align(context[:-1])
        trees = [TR.layout(len(blk), req.alts) if req.alts else None
                 for _, _, req, _, blk in ready]
        rows = [[ctx[-1]] + blk + ([t for _, t, _ in tr.sib_rows] if tr else [])
                for (*_, ctx, blk), tr in zip(ready, trees)]
        # the pass packs the rows one after another: row b's hidden states start here
        starts = [sum(len(r) for r in rows[:b]) for b in range(len(rows))]
        wants = [(starts[b], *row, sinks[row[0]]) for b, row in enumerate(ready)
                 if sinks is not None and sinks[row[0]] is not None]
        self._early = (time.perf_counter(), wants) if wants and self.early_head else None
        hook = None
        if self.semantic is not None and any(s.acceptance == "semantic"
                                             for _, s, *_ in ready):
            hook = self.model.get_output_embeddings().register_forward_pre_hook(
                self._hidden_hook)
        self._hidden = None
        try:
            logits = batched_forward([s.kv for _, s, *_ in ready], rows,
                                     trees if any(trees) else None)
        finally:
            self._early = None
            if hook is not None:
                hook.remove()
        hidden, self._hidden = self._hidden, None
        share = (time.perf_counter() - t0) / len(ready)   # cost per block, seconds
        self.passes += 1
        for b, ((i, s, req, context, block), lg, tr) in enumerate(
                zip(ready, logits, trees)):
            h = (hidden[0, starts[b]:starts[b] + len(block) + 1] if hidden is not None
                 and s.acceptance == "semantic" else None)
            results[i] = (self._decide(s, req, context, block, lg, share, h) if tr is None
                          else self._decide_tree(s, req, context, block, lg, tr, share))
            self._count_early(req, results[i])
        return results

    def _hidden_hook(self, module, args) -> None:
        """Forward pre-hook on the LM head, registered for a pass that holds a semantic
        row: keep its input (the final norm's output, [1, sum T_b, H]: rows packed)."""
        self._hidden = args[0].detach()

    # ------------------------------------------------------------------ early exit

    def _exit_hook(self, module, args, out) -> None:
        """Forward hook on the exit layer: send each waiting row its provisional
        verdict (once per pass). Never fails the pass: an error is logged."""
        ctx, self._early = self._early, None
        if ctx is None:
            return
        t0, rows = ctx
        h = out[0] if isinstance(out, tuple) else out     # [1, sum T_b, H]: rows packed
        for start, i, s, req, context, block, sink in rows:
            try:
                q = None if s.cfg.greedy else _q_tok(s, req, block)
                a, nxt = provisional_verdict(
                    s.cfg, s.seed, context, block, q,
                    self.early_head.logits(h[0, start:start + len(block) + 1]),
                    self.early_head.accept_topk)
                self._provisional[id(req)] = (a, nxt)
                sink(EarlyVerdict(req.block_seq, a, nxt, self.early_head.layer,
                                  time.perf_counter() - t0))
            except Exception:  # noqa: BLE001 - the early verdict is advisory only
                log.exception("early exit failed for session %s", s.id)

    def _count_early(self, req: VerifyRequest, res) -> None:
        """Count an early verdict and whether the final one matched it."""
        prov = self._provisional.pop(id(req), None)
        if prov is None or not isinstance(res, VerifyResponse):
            return
        hit = prov == (res.accepted, res.next_token)
        self.early_frames += 1
        self.early_hits += hit
        if self.on_early_outcome is not None:
            self.on_early_outcome(hit)

    def ready_blocks(self, items: list[tuple[Session, VerifyRequest]]) -> tuple[list, list]:
        """Check every (session, request) pair. Returns ``(results, ready)``: one slot
        per item (its ApiError, or None), and ``(index, session, request, context,
        block ids)`` of the blocks that passed; ``context`` is the confirmed prefix plus
        any pending correction token."""
        results: list = [None] * len(items)
        ready = []
        for i, (s, req) in enumerate(items):
            try:
                self.check(s, req)
            except ApiError as e:
                results[i] = e
                continue
            context = s.tokens + ([req.pending_commit] if s.awaiting else [])
            ready.append((i, s, req, context, [int(t) for t in req.tokens]))
        return results, ready

    def verify(self, s: Session, req: VerifyRequest) -> VerifyResponse:
        """Verify one block (a batch of one). Raises ApiError."""
        out = self.verify_batch([(s, req)])[0]
        if isinstance(out, ApiError):
            raise out
        return out

    # ------------------------------------------------------------------ one block

    def check(self, s: Session, req: VerifyRequest) -> None:
        """State checks before any mutation. Raises ApiError (409/422)."""
        if req.session_id != s.id:
            raise ApiError(422, "bad_field", "session_id does not match the URL", "session_id")
        if req.config_id != s.cfg.config_id:
            raise ApiError(409, "config_mismatch", "config_id differs from the session's",
                           "config_id", state=s.state())
        if req.block_seq != s.next_seq or req.base_len != s.base_len:
            raise ApiError(409, "stale_block", "block does not extend the confirmed prefix",
                           "block_seq" if req.block_seq != s.next_seq else "base_len",
                           state=s.state())
        if req.expect_last is not None and (s.awaiting or s.tokens[-1] != req.expect_last):
            raise ApiError(409, "stale_block", "block was sent ahead on an outcome of the "
                           "previous block that did not happen", "expect_last",
                           state=s.state())
        if req.channel is not None and s.acceptance != "semantic":
            raise ApiError(422, "bad_field", "channel state is sent by semantic sessions "
                           "only", "channel")
        if s.awaiting != (req.pending_commit is not None):
            raise ApiError(422, "bad_field", "pending_commit required" if s.awaiting
                           else "no correction is pending", "pending_commit")
        if s.awaiting:
            seq, p_row = s.pending_p
            if p_row[req.pending_commit] <= 0:
                raise ApiError(422, "bad_field", "pending_commit has zero target probability",
                               "pending_commit")
        g = len(req.tokens)
        if req.alts is not None:
            if (not self.supports_trees or not s.cfg.greedy or s.mode != "asym"
                    or s.acceptance != "exact"):
                raise ApiError(422, "bad_field", "siblings (a token tree) need a greedy "
                               "config, exact acceptance, the compact protocol and a "
                               "torch verifier", "alts")
            rows = 1 + g + sum(len(a) for a in req.alts)
            if rows > self.max_tree_rows:
                raise ApiError(422, "bad_field", f"tree of {rows} rows exceeds the limit "
                               f"of {self.max_tree_rows}", "alts")
        if s.base_len + g + 1 > self.max_context:
            raise ApiError(422, "context_full", "block would exceed the model context", "tokens")
        if s.cfg.greedy:
            if s.mode == "standard" and req.q_full is None and g:
                raise ApiError(422, "bad_field", "standard mode uploads q_full", "q_full")
        elif s.mode == "standard":
            if req.q_full is None and g:
                raise ApiError(422, "bad_field", "standard mode uploads q_full", "q_full")
        elif req.q_tok is None and g:
            raise ApiError(422, "bad_field", "sampling configs need q for each draft", "q")

    def check_acceptance(self, acceptance: str, cfg: S.SamplingConfig) -> None:
        """May a session be created with ``acceptance``? Raises ApiError 422 (field
        ``acceptance``): ``bad_field`` for semantic acceptance with a sampling config
        (WISV decides greedy blocks only), ``semantic_unavailable`` when this server has
        no decision head loaded."""
        if acceptance != "semantic":
            return
        if not cfg.greedy:
            raise ApiError(422, "bad_field", "semantic acceptance needs a greedy sampling "
                           "config (temperature 0)", "acceptance")
        if self.semantic is None:
            raise ApiError(422, "semantic_unavailable", "this server has no WISV decision "
                           "head loaded (specrelay serve --wisv-head)", "acceptance")

    def _decide(self, s: Session, req: VerifyRequest, context: list[int],
                block: list[int], logits: torch.Tensor, target_s: float,
                hidden: torch.Tensor | None = None) -> VerifyResponse:
        """Apply the acceptance rule to the target logits [g+1, V] of one block and
        commit: confirmed += accepted drafts (semantic ones included) (+ next token);
        cache = confirmed[:-1]. ``hidden`` [g+1, H]: the LM head's input rows of the
        block (semantic sessions only)."""
        a, nxt, corr, p_rej, ties, sem = self._verdict(s, req, context, block, logits,
                                                       hidden)
        self._crop(s, len(context) + a)
        s.tokens = context + block[:a] + ([nxt] if nxt is not None else [])
        s.awaiting = corr is not None
        s.pending_p = (req.block_seq, p_rej) if corr is not None else None
        s.next_seq += 1
        self._check_cache(s)
        self.target_seconds += target_s
        if sem is not None:
            self.semantic_accepted += len(sem)
        return VerifyResponse(req.block_seq, a, nxt, corr, s.base_len, target_s, ties, sem)

    def _decide_tree(self, s: Session, req: VerifyRequest, context: list[int],
                     block: list[int], logits: torch.Tensor, tree: TR.TreeLayout,
                     target_s: float) -> VerifyResponse:
        """Greedy verdict of a sibling tree (logits [T, V] of the tree's rows) and its
        commit: confirmed += accepted drafts (+ the accepted sibling) + next token; the
        cache is cut to the accepted branch (confirmed[:-1])."""
        g = len(block)
        x = S.process_block(logits[: g + 1], s.cfg, context, block)
        a, nxt = S.greedy_verify(torch.tensor(block, dtype=torch.long), x)
        sib, ties = None, self.tie_offsets(x[: a + 1])
        if a < g:
            r = TR.sibling_row(tree, a, nxt)
            if r is not None:
                sib = nxt
                xs = S.process_next(logits[r], s.cfg, context + block[:a] + [sib])
                nxt = int(S.greedy_token(xs))
                ties = ties + tuple(a + 1 for _ in self.tie_offsets(xs[None]))
        C = len(context)
        if sib is None:
            self._crop(s, C + a)
            s.tokens = context + block[:a] + [nxt]
        else:
            s.kv.keep(C + a, [C - 1 + r])
            s.tokens = context + block[:a] + [sib, nxt]
            self.sibling_hits += 1
        s.awaiting, s.pending_p = False, None
        s.next_seq += 1
        self._check_cache(s)
        self.target_seconds += target_s
        return VerifyResponse(req.block_seq, a, nxt, None, s.base_len, target_s, ties,
                              sibling=sib)

    def _verdict(self, s: Session, req: VerifyRequest, context: list[int],
                 block: list[int], logits: torch.Tensor,
                 hidden: torch.Tensor | None = None) -> tuple:
        """The decision on one block from its target logits [g+1, V] (rows after
        ``context + block[:i]``; ``-inf`` where a scoring backend returned no score):
        (accepted, next token or None, Correction or None, rejected p row or None,
        near-tie offsets, semantic offsets or None for an exact session). Mutates
        nothing but the head's call counter."""
        x = S.process_block(logits, s.cfg, context, block)      # float64 [g+1, V]
        # indexed by the block's position, not its sequence number: a session re-created
        # from the confirmed prefix after a restart draws exactly what the lost one would
        gen = rng.generator(s.seed, rng.VERIFY, len(context))
        if s.cfg.greedy:
            blk = torch.tensor(block, dtype=torch.long)
            a, nxt = S.greedy_verify(blk, x)
            sem = None
            if s.acceptance == "semantic":
                a, nxt, sem = self._semantic_walk(req, blk, x, hidden, a, nxt)
            return a, nxt, None, None, self.tie_offsets(x[: a + 1]), sem
        p = torch.softmax(x, dim=-1)
        a, nxt, corr, p_rej = self._sample_verdict(s, req, logits, p, context, block, gen)
        return a, nxt, corr, p_rej, (), None

    def _semantic_walk(self, req: VerifyRequest, blk: torch.Tensor, x: torch.Tensor,
                       hidden: torch.Tensor | None, a: int, nxt: int
                       ) -> tuple[int, int, tuple]:
        """WISV's greedy verdict (WISV §III-A): from the exact verdict ``(a, nxt)`` of
        draft ``blk`` [g] on processed rows ``x`` [g+1, V], walk on along the block. At
        a mismatch (draft != argmax) the decision head reads ``hidden`` [g+1, H] (the
        LM head's input) and the row; the draft is accepted when P(accept) >= tau(the
        request's channel), and the walk goes on (the row after it is conditioned on
        it already); otherwise, or past ``max_per_block`` semantic acceptances, or at a
        mismatch the token guard refuses (:meth:`~cloud_api.wisv.serving.
        SemanticAcceptance.allowed`), the block stops there with the argmax as next
        token. One head call per block whose first mismatch the guard allows. Returns
        ``(accepted, next token, semantic offsets)``."""
        g = blk.numel()
        sa = self.semantic
        if a == g:
            return a, nxt, ()
        if sa is None or hidden is None:
            raise AssertionError("a semantic session without a decision head or hidden "
                                 "states")
        best = S.greedy_token(x[:g])
        miss = torch.nonzero(blk != best).flatten()[:sa.max_per_block]
        ok = sa.allowed(blk[miss], best[miss])                      # the token guard
        if not bool(ok[0]):              # the first mismatch is guarded: exact verdict
            return a, nxt, ()
        probs = sa.probs(hidden[miss], x[miss], blk[miss])          # [m], m >= 1
        tau = sa.threshold(req.channel)
        sem: list[int] = []
        for pos, p, k in zip(miss.tolist(), probs.tolist(), ok.tolist()):
            if pos != a or p < tau or not k:   # the walk stopped before, the head
                break                          # refuses, or the guard does
            sem.append(pos)
            a2, nxt = S.greedy_verify(blk[pos + 1:], x[pos + 1:])
            a = pos + 1 + a2
        return a, nxt, tuple(sem)

    def _crop(self, s: Session, length: int) -> None:
        """Keep the first ``length`` positions of the session's target cache."""
        s.kv.crop(length)

    def _check_cache(self, s: Session) -> None:
        s.check_kv()

    # the verifier interface (cloud_api.scoring.interface.VerifierBackend)

    def open(self, s: Session) -> float:
        """A new session: prefill its cache (:meth:`prefill`). Returns seconds."""
        return self.prefill(s)

    def close(self, s: Session) -> None:
        """A session's end: its cache goes with the session object."""

    def tie_offsets(self, logits: torch.Tensor) -> tuple:
        """Offsets of the rows of ``logits`` [n, V] (the committed greedy positions) whose
        top-2 gap is below :attr:`near_tie_gap`; counted in :attr:`near_ties`."""
        gaps = S.top2_gap(logits)
        ties = tuple(int(i) for i in torch.nonzero(gaps < self.near_tie_gap).flatten())
        self.near_ties += len(ties)
        return ties

    def _sample_verdict(self, s: Session, req: VerifyRequest, logits, p, context, block,
                        gen):
        """Sampling verdict of one block: logits [g+1, V] raw and p float64 [g+1, V]
        processed target rows after ``context + block[:i]``. Returns (accepted, next
        token or None, Correction or None, the rejected position's p row or None)."""
        g = len(block)
        a = S.sampled_accepts(p, block, _q_tok(s, req, block), gen) if g else 0
        if a == g:                                   # all accepted: bonus from p_{g+1}
            return a, S.sample_next(logits[g], s.cfg, context + block, gen)[0], None, None
        if s.mode == "standard":                     # baseline: cloud draws the residual
            q_row = torch.tensor(np.array(req.q_full[a]))
            return a, int(S.sample(S.residual(p[a], q_row), gen)), None, None
        ids, sp = S.top_support(p[a], s.support_k)
        complete = bool(S.support_is_complete(p[a], s.support_k))
        ids, sp = ids[sp > 0], sp[sp > 0]
        n = s.n_proposals
        props = S.sample(p[a].expand(n, -1), gen) if n else torch.zeros(0, dtype=torch.long)
        corr = Correction(complete, ids.numpy(), sp.numpy(), props.numpy(),
                          p[a][props].numpy())
        return a, None, corr, p[a].clone()

    def correction(self, s: Session, req: CorrectionRequest) -> CorrectionResponse:
        """More correction information for the block awaiting its correction token:
        a larger top-K support (``k``) or the full distribution (``k`` None)."""
        if not s.awaiting or s.pending_p is None or s.pending_p[0] != req.block_seq:
            raise ApiError(409, "no_pending_correction",
                           "that block has no correction pending", "block_seq",
                           state=s.state())
        p_row = s.pending_p[1]
        if req.k is None:
            return CorrectionResponse(req.block_seq, True, None, p_row.numpy())
        ids, sp = S.top_support(p_row, req.k)
        complete = bool(S.support_is_complete(p_row, req.k))
        ids, sp = ids[sp > 0], sp[sp > 0]
        return CorrectionResponse(req.block_seq, complete, ids.numpy(), sp.numpy())
