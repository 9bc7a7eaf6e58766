"""Client of the cloud's streaming target-only route (``POST
/v1/sessions/{id}/generate``, see ``cloud_api/stream.py``): the target alone generates
and streams msgpack token records down; the edge only reads (the ``cloud-ar`` baseline).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import aiohttp
import msgpack

from bench.modes.measure import RecordingTransport
from edge_sdk.protocol import wire
from edge_sdk.protocol.sampling import SamplingConfig
from edge_sdk.transport import RemoteError

__all__ = ["CloudStreamClient"]


@dataclass
class _Stream:
    """What one streamed completion delivered: token emission times (s since
    ``t_start``), near-tie token indices, target seconds and passes, body bytes down,
    the first token's ``perf_counter`` time and the server's finish reason."""

    t_start: float
    times: list[float] = field(default_factory=list)
    ties: list[int] = field(default_factory=list)
    target_s: float = 0.0
    passes: int = 0
    down: int = 0
    t_first: float | None = None
    server_reason: str | None = None

    def take(self, item, committer, now: float, msg_token: int, msg_done: int) -> None:
        """Account one stream record (``[MSG_TOKEN, id, target_s, near_tie?]`` or
        ``[MSG_DONE, reason, ...]``) and commit its token."""
        if item[0] == msg_token:
            self.target_s += float(item[2])
            self.passes += 1
            if not committer.done:
                if len(item) > 3 and item[3]:
                    self.ties.append(len(committer.token_ids))
                committer.push(int(item[1]))
                self.times.append(now - self.t_start)
                self.t_first = self.t_first or now
        elif item[0] == msg_done:
            self.server_reason = item[1]


async def _raise_remote(r) -> None:
    """Raise :class:`RemoteError` for an HTTP error answer (JSON body when it parses)."""
    raw = await r.read()
    try:
        import json

        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    raise RemoteError(r.status, parsed, raw[:200].decode("utf8", "replace"))


class CloudStreamClient:
    """Client of the streaming target-only route (``cloud_api/stream.py``).

    Args:
        base_url: the API, e.g. ``http://127.0.0.1:8000``.
        tokenizer: for the tokenizer fingerprint and the committed text.
        signer: request signer or None (unauthenticated server).
        timeout_s: whole-request timeout in seconds.
    """

    def __init__(self, base_url: str, tokenizer, signer=None, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.tokenizer, self.signer = tokenizer, signer
        self.transport = RecordingTransport(base_url, signer=signer, timeout_s=timeout_s)
        self._http: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def close(self) -> None:
        await self.transport.close()
        if self._http is not None:
            await self._http.close()

    async def _open_session(self, prompt_ids: list[int], cfg: SamplingConfig, seed: int,
                            max_new_tokens: int) -> dict:
        from edge_sdk.models import tokenizer_fingerprint

        body = wire.pack({"prompt_packed": wire.pack_prompt(prompt_ids), "sampling": cfg.to_dict(),
                          "seed": seed, "max_new_tokens": max_new_tokens,
                          "tokenizer_hash": tokenizer_fingerprint(self.tokenizer)})
        data, _ = await self.transport.request("POST", "/v1/sessions", body)
        return wire.unpack(data)

    async def _read_stream(self, path: str, headers: dict, committer, st: _Stream) -> None:
        from cloud_api.stream import MSG_DONE, MSG_TOKEN

        async with self._http.post(self.base_url + path, data=b"",
                                   headers=headers) as r:
            if r.status >= 400:
                await _raise_remote(r)
            unpacker = msgpack.Unpacker(raw=False)
            async for chunk in r.content.iter_any():
                st.down += len(chunk)
                unpacker.feed(chunk)
                now = time.perf_counter()
                for item in unpacker:
                    st.take(item, committer, now, MSG_TOKEN, MSG_DONE)

    def _result(self, committer, st: _Stream, t_end: float) -> dict:
        finish = committer.finish_reason or st.server_reason or "length"
        calls = self.transport.calls
        up_b = sum(c.up_bytes for c in calls)
        down_b = sum(c.down_bytes for c in calls) + st.down
        n = len(committer.token_ids)
        t_start, t_first = st.t_start, st.t_first or t_end
        m = {"committed_tokens": n, "wall_s": t_end - t_start, "ttft_s": t_first - t_start,
             "decode_s": t_end - t_first if n > 1 else 0.0, "token_times_s": st.times,
             "drafted_tokens": 0, "accepted_tokens": 0, "rounds": 0,
             "uplink_bytes": up_b, "downlink_bytes": down_b, "target_passes": st.passes,
             "target_seconds": st.target_s, "wasted_draft_tokens": 0,
             "correction_mode_counts": {"bounded": 0, "proposal": 0, "full": 0},
             "tv_budget_spent": 0.0, "draft_seconds": 0.0,
             "near_tie_tokens": len(st.ties), "near_tie_positions": st.ties,
             "http_exchanges": len(calls) + 1}
        return {"token_ids": list(committer.token_ids), "text": committer.text,
                "finish_reason": finish, "metrics": m}

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig | None = None,
                       max_new_tokens: int = 128, seed: int = 0) -> dict:
        """Create a session and stream its completion.

        Returns ``{"token_ids", "text", "finish_reason", "metrics"}``; ``metrics`` holds
        the per-request fields of ``report.aggregate`` (``committed_tokens``, ``wall_s``,
        ``ttft_s``, ``token_times_s`` (s since start), ``uplink_bytes``/``downlink_bytes``
        (bodies), ``target_passes``, ``target_seconds``, ``http_exchanges``).
        Raises :class:`RemoteError` when the API refuses.
        """
        from edge_sdk.commit import Committer

        cfg = sampling or SamplingConfig()
        self.transport.calls.clear()
        st = _Stream(time.perf_counter())
        info = await self._open_session(prompt_ids, cfg, seed, max_new_tokens)
        sid = int(info["session_id"])
        committer = Committer(self.tokenizer, max_new_tokens, info.get("eos_token_ids", []))
        path = f"/v1/sessions/{sid}/generate"
        headers = dict(self.signer.headers("POST", path, b"")) if self.signer else {}
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=self._timeout)
        try:
            await self._read_stream(path, headers, committer, st)
            t_end = time.perf_counter()
        finally:
            try:
                await self.transport.request("DELETE", f"/v1/sessions/{sid}")
            except Exception:  # noqa: BLE001 - best effort; the TTL evicts anyway
                pass
        return self._result(committer, st, t_end)
