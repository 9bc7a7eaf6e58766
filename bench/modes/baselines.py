"""The baselines every speculative mode is measured against:

* ``cloud-ar`` — the cloud generates with the target alone and streams the tokens
  (:class:`~bench.modes.cloud_stream.CloudStreamClient`); the edge only reads. One
  target pass per token.
* ``standard-sd`` — standard edge-cloud speculative decoding (Leviathan et al. 2023,
  §2.3, split across the link): :class:`edge_sdk.EdgeClient` ``mode="standard"``
  uploads the full draft distribution ``q`` (float64, ``V`` values per draft position)
  and the cloud draws the corrections.
"""
from __future__ import annotations

from bench.modes.base import BenchMode, BenchRequest, RequestRecord
from bench.modes.cloud_stream import CloudStreamClient
from bench.modes.edge_rounds import EdgeClientMode
from bench.modes.measure import LinkMeter, breakdown
from bench.modes.registry import register_mode

__all__ = ["CloudARMode", "StandardSDMode"]


@register_mode
class CloudARMode(BenchMode):
    """Target-only autoregressive generation in the cloud, tokens streamed down."""

    name = "cloud-ar"
    description = "cloud target alone, streamed tokens (one target pass per token)"
    needs_drafter = False
    baseline = True

    async def open(self) -> None:
        c = self.ctx
        self.client = CloudStreamClient(c.base_url, c.tokenizer, signer=c.signer)

    async def close(self) -> None:
        await self.client.close()

    async def run_request(self, req: BenchRequest) -> RequestRecord:
        c = self.ctx
        meter = LinkMeter(c)
        res = await self.client.generate(list(req.prompt_ids), c.sampling,
                                         c.max_new_tokens, req.seed)
        m = res["metrics"]
        up, down = meter.delta(m["uplink_bytes"], m["downlink_bytes"])
        m.update(link_uplink_bytes=up, link_downlink_bytes=down,
                 prompt_tokens=len(req.prompt_ids),
                 breakdown_s=breakdown(m["wall_s"], 0.0, m["target_seconds"],
                                       m["http_exchanges"], up, down, c.profile))
        return RequestRecord(req, m, res["token_ids"], res["text"], res["finish_reason"])


@register_mode
class StandardSDMode(EdgeClientMode):
    """Baseline edge-cloud SD: full q uploaded per draft position."""

    name = "standard-sd"
    description = "standard edge-cloud SD: full draft distribution on the uplink"
    baseline = True
    client_mode = "standard"
