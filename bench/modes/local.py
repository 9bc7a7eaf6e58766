"""The local-target modes (CATS): the target on the device under a memory budget, no
cloud and no link. ``local-offload-ar`` is the offloaded target alone (one streamed
pass per token); ``cats`` is self-speculative cascaded decoding on the same target
(:mod:`edge_sdk.local_target.cats`). ``specrelay bench`` runs them through
:func:`bench.local.run.run_local_bench` (one fresh process per budget and storage, for
its peak RSS), never in a cloud run; :meth:`run_request` serves in-process callers that
put a :class:`~edge_sdk.local_target.session.LocalSession` in
``ctx.options["local_session"]``.
"""
from __future__ import annotations

from typing import ClassVar

from bench.modes.base import BenchMode, BenchRequest, RequestRecord
from bench.modes.registry import register_mode

__all__ = ["LocalMode", "LocalOffloadArMode", "CatsMode"]


class LocalMode(BenchMode):
    """A mode that runs the target locally (``local = True``: the bench runs it apart)."""

    local: ClassVar[bool] = True
    needs_drafter: ClassVar[bool] = False
    method: ClassVar[str] = "cats"

    async def run_request(self, req: BenchRequest) -> RequestRecord:
        """Generate ``req`` on ``ctx.options["local_session"]``. Raises KeyError when
        there is none (the bench's local runner builds one per cell)."""
        sess = self.ctx.options["local_session"]
        sess.method = self.method
        toks, st = sess.generate(list(req.prompt_ids), self.ctx.max_new_tokens,
                                 self.ctx.sampling, req.seed)
        eos = bool(toks) and toks[-1] in sess.eos
        return RequestRecord(req, st.to_dict(), toks, "", "stop" if eos else "length")


@register_mode
class LocalOffloadArMode(LocalMode):
    name = "local-offload-ar"
    description = ("baseline: the target on the device under --memory-budget, resident "
                   "layers + the rest streamed from storage per token (no cloud)")
    baseline = True
    method = "ar"


@register_mode
class CatsMode(LocalMode):
    name = "cats"
    description = ("CATS: self-speculative drafting from the resident layers + a tuned "
                   "exit head, one streamed verification pass per block (no cloud)")
    method = "cats"
