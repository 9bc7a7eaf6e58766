"""One object for callers (CLI, SDK, bench): a budgeted local target with its plan and
drafting head, that generates with CATS or with the target alone.

Building one: :func:`build_local` opens the checkpoint under the budget
(:func:`~edge_sdk.local_target.load.open_local_target`) and gets the tuned exit head at
the plan's exit layer (cached, else fitted on the calibration sequences the caller
passes), or, for a ``skip`` plan, the layer-skipping draft (:mod:`.skip`: nothing to
fit). Drafting depth and the cascade's gate come from the plan (:mod:`.budget`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from edge_sdk.kvmodel import common_prefix

from edge_sdk.local_target.cats import CatsDecoder, LocalStats, decode_ar
from edge_sdk.local_target.load import (DRAFT_VOCAB, LocalTarget, local_head,
                                        open_local_target)
from edge_sdk.protocol.sampling import SamplingConfig

__all__ = ["LocalSession", "build_local"]


@dataclass
class LocalSession:
    """A ready local target. ``method``: ``cats`` or ``ar`` (the target alone);
    ``depth`` / ``width`` / ``beam`` / ``nodes`` override the plan's (None: the
    plan's; ``beam=1``: chains with siblings)."""

    local: LocalTarget
    eos: tuple = ()
    method: str = "cats"
    depth: int | None = None
    width: int | None = None
    beam: int | None = None
    nodes: int | None = None
    _held: list = field(default_factory=list, repr=False)   # tokens in the KV cache

    @property
    def plan(self):
        return self.local.plan

    def tree(self) -> tuple[int, int]:
        """``(beam, nodes)`` of the draft trees in use: the overrides, else the plan's
        (beam 1: chains, nodes 0)."""
        p = self.local.plan
        beam = max(1, p.beam if self.beam is None else self.beam)
        return beam, (self.nodes or p.nodes or 1) if beam > 1 else 0

    def decoder(self) -> CatsDecoder:
        """The CATS decoder of the plan (overrides: :attr:`depth`, :attr:`width`,
        :meth:`tree`)."""
        p = self.local.plan
        beam, nodes = self.tree()
        return CatsDecoder(self.local.target, self.local.head, self.depth or p.depth, p.gate,
                           p.width if self.width is None else self.width,
                           beam=beam, nodes=max(1, nodes))

    def generate(self, prompt: Sequence[int], max_new_tokens: int,
                 cfg: SamplingConfig = SamplingConfig(), seed: int = 0
                 ) -> tuple[list[int], LocalStats]:
        """Tokens after ``prompt`` (at most ``max_new_tokens``, EOS included) and the
        stats. Every token is the full target's (greedy: identical to
        :func:`decode_ar`)."""
        self._held = []                      # the decoders below reset the cache
        if self.method == "ar" or self.local.head is None or not self.plan.depth:
            return decode_ar(self.local.target, list(prompt), max_new_tokens, cfg, seed,
                             self.eos)
        return self.decoder().generate(list(prompt), max_new_tokens, cfg, seed, self.eos)

    def step(self, ids: Sequence[int], max_tokens: int, cfg: SamplingConfig = SamplingConfig(),
             seed: int = 0) -> list[int]:
        """The next tokens after ``ids`` from ONE round (the cloud-loss policy
        ``local``: called per step while the cloud is lost): the cache is brought to
        ``ids[:-1]`` (rolling back what diverges, running what is missing: one streamed
        pass at a handover), then a CATS round of at most ``max_tokens - 1`` drafts
        (``ar``: none). Returns 1..``max_tokens`` tokens, all the full target's.
        Raises ValueError for empty ``ids`` or ``max_tokens < 1``."""
        ids = list(ids)
        if not ids or max_tokens < 1:
            raise ValueError("step() needs a prefix and max_tokens >= 1")
        t = self.local.target
        keep = common_prefix(self._held, ids[:-1])
        t.crop(keep)
        if len(ids) - 1 > keep:
            t.run_layers(t.embed(ids[keep:-1]), 0, t.num_layers)
        k = 0 if self.method == "ar" or not self.plan.depth else min(
            self.depth or self.plan.depth, max_tokens - 1)
        if self.local.head is None:
            new = self._ar_round(ids, cfg, seed)
        else:
            new = self.decoder().round(ids, k, cfg, seed)[0]
        new = new[:max_tokens]
        t.crop(len(ids) + len(new) - 1)
        self._held = (ids + new)[:-1]
        return new

    def _ar_round(self, ids: list[int], cfg, seed: int) -> list[int]:
        """One target-alone step (no exit head): ``[token]``."""
        from edge_sdk.local_target.cats import rng, S

        lg = self.local.target.run_layers(self.local.target.embed([ids[-1]]), 0,
                                          self.local.target.num_layers)
        gen = rng.generator(seed, rng.LOCAL_VERIFY, len(ids))
        return [S.sample_next(self.local.target.logits(lg)[0], cfg, ids, gen)[0]]

    def describe(self) -> dict:
        """The plan, the measured resident bytes (the target's; ``draft_bytes``: the
        quantized self-draft's 4-bit layers, 0 for the other drafts, whose bytes are
        the target's), the storage profile and the draft tree actually used (``beam``,
        ``nodes``; beam 1: chains) (JSON-able)."""
        from edge_sdk.local_target.quant import QuantDraft

        t, (beam, nodes) = self.local.target, self.tree()
        head = self.local.head
        return {"plan": self.plan.to_dict(), "resident_bytes": t.resident_bytes(),
                "draft_bytes": head.nbytes() if isinstance(head, QuantDraft) else 0,
                "storage": t.storage.profile.name,
                "storage_bytes_per_s": t.storage.profile.bytes_per_s,
                "exit_head": getattr(self.local.head, "name", None), "method": self.method,
                "beam": beam, "nodes": nodes}


def build_local(name: str, budget, storage: str = "nvme", dtype: str = "bfloat16",
                method: str = "cats", calibration: Callable[[object], list] | None = None,
                depth: int | None = None) -> LocalSession:
    """Open ``name`` under ``budget`` on ``storage`` and attach the drafting head.

    Args:
        calibration: ``tokenizer -> token sequences`` used to fit the exit head when
            none is cached (None: the head must be cached).
    Raises:
        ValueError: budget too small / unparsable, unknown method.
        LookupError: no cached head and no calibration.
    """
    from edge_sdk.models import eos_ids

    if method not in ("cats", "ar"):
        raise ValueError(f"local method {method!r}: expected cats or ar")
    local = open_local_target(name, budget, storage, dtype, quant=method == "cats")
    if method == "cats" and local.plan.draft == "skip" and local.plan.depth:
        from edge_sdk.local_target.skip import SkipDraft
        local.head = SkipDraft(local.target, DRAFT_VOCAB)
    elif method == "cats" and local.plan.draft == "quant" and local.plan.depth:
        from edge_sdk.local_target.quant import QuantDraft
        local.head = QuantDraft(local.target, DRAFT_VOCAB)
    elif method == "cats" and local.plan.exit_layer:
        with local.target.storage.unthrottled():                    # fit unthrottled
            seqs = None
            if calibration is not None:
                from edge_sdk.exit_store import load_exit_head
                if load_exit_head(local.target.model, local.plan.exit_layer, 32768) is None:
                    seqs = calibration(local.tokenizer)
            local.head = local_head(local.target, local.plan.exit_layer, 32768, seqs)
    eos = tuple(eos_ids(local.target.model, local.tokenizer))
    return LocalSession(local, eos, method, depth)
