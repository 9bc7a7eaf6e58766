"""The mechanism every edge-drafting mode shares: one :class:`edge_sdk.EdgeClient`,
requests one after another, each round reported through the SDK's public ``on_round``
hook (``metrics["round_trace"]``). Registers no mode itself (the families:
:mod:`bench.modes.baselines` ``standard-sd``, :mod:`bench.modes.speculative`,
:mod:`bench.modes.adaptive`)."""
from __future__ import annotations

from typing import ClassVar, Hashable

from bench.modes.base import BenchMode, BenchRequest, RequestRecord
from bench.modes.measure import LinkMeter, RecordingTransport, breakdown

__all__ = ["EdgeClientMode"]


class EdgeClientMode(BenchMode):
    """EdgeClient rounds; ``client_mode`` picks the protocol. ``client_kw`` are
    :class:`edge_sdk.EdgeClient` options (``ctx.options["client"]`` overrides them); a
    controller given by name becomes ONE object serving every request of the run
    (requests run one after another), so learning controllers keep what they learned.
    ``fixed_depth`` overrides ``--depth``; ``ngram``: the n-gram drafter fronts the
    model drafter. ``link_from_profile``: the client reports the emulated profile's RTT
    and uplink rate as its channel state (``EdgeClient(link=...)``, WISV's semantic
    sessions). ``ctx.options["generate"]`` maps a workload label to extra
    ``generate`` arguments of its requests (``stop`` strings, a smaller
    ``max_new_tokens``)."""

    client_mode: ClassVar[str] = "asym"
    client_kw: ClassVar[dict] = {}
    fixed_depth: ClassVar[int | None] = None
    ngram: ClassVar[bool] = False
    link_from_profile: ClassVar[bool] = False

    POLICY_KW: ClassVar[frozenset] = frozenset({"controller", "controller_kw",
                                                "proactive_min_hit"})
    """``client_kw`` keys that only choose a depth or whether to draft ahead: modes that
    differ in them alone share a warm-up request."""

    @classmethod
    def warmup_key(cls) -> Hashable:
        """The protocol, the drafting mechanism (proactive kind, sibling trees, sending
        ahead, n-gram fronting, early verdicts, the reported link) and every
        ``client_kw`` option but the depth and proactive policies (:attr:`POLICY_KW`):
        caac, fixed-N and stop-and-wait share one warm-up, ipdg and ipdg-skip another."""
        kw = tuple(sorted((k, repr(v)) for k, v in cls.client_kw.items()
                          if k not in cls.POLICY_KW))
        return ("edge-client", cls.client_mode, kw, cls.ngram, cls.link_from_profile,
                cls.early_exit)

    async def open(self) -> None:
        from edge_sdk.client import EdgeClient
        from edge_sdk.control import make_controller

        c = self.ctx
        # a mode that names no proactive drafting is stop-and-wait, and one that names
        # no trees drafts chains (not the SDK's defaults)
        kw = {"proactive": "off", "controller": "fixed", "siblings": 0, **self.client_kw,
              **c.options.get("client", {})}
        if self.link_from_profile:        # the channel state a semantic session reports
            kw.setdefault("link", c.profile)
        if isinstance(kw.get("controller"), str) and kw["controller"] != "fixed":
            kw["controller"] = make_controller(kw["controller"],          # --depth / MODE@N
                                               default_depth=self.fixed_depth or c.depth,
                                               **kw.pop("controller_kw", {}) or {})
        drafter = c.drafter
        if self.ngram and drafter is not None:
            from edge_sdk.drafters.ngram import NgramDrafter

            drafter = NgramDrafter(base=drafter)
        self.transport = RecordingTransport(c.base_url, signer=c.signer)
        self.client = EdgeClient(c.base_url, drafter, c.tokenizer,
                                 depth=self.fixed_depth or c.depth, mode=self.client_mode,
                                 signer=c.signer, chat=False, transport=self.transport, **kw)

    async def close(self) -> None:
        await self.client.close()

    async def run_request(self, req: BenchRequest) -> RequestRecord:
        c = self.ctx
        self.transport.calls.clear()
        meter = LinkMeter(c)
        trace: list[dict] = []
        extra = dict((c.options.get("generate") or {}).get(req.workload) or {})
        extra.setdefault("max_new_tokens", c.max_new_tokens)
        res = await self.client.generate(prompt_ids=list(req.prompt_ids),
                                         sampling=c.sampling, on_round=trace.append,
                                         seed=req.seed, **extra)
        m = dict(res.metrics, round_trace=trace)
        m.setdefault("semantic_accepted_tokens",
                     int(getattr(res, "semantic_accepted_tokens", 0) or 0))
        calls = self.transport.calls
        up, down = meter.delta(m["uplink_bytes"], m["downlink_bytes"])
        m.update(link_uplink_bytes=up, link_downlink_bytes=down, http_exchanges=len(calls),
                 prompt_tokens=len(req.prompt_ids),
                 breakdown_s=breakdown(m["wall_s"], m["draft_seconds"], m["target_seconds"],
                                       len(calls), up, down, c.profile))
        return RequestRecord(req, m, list(res.token_ids), res.text, res.finish_reason)
