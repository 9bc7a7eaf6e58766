"""Prometheus /metrics: request counts, the shared counters, batch sizes, sessions."""

import asyncio

import aiohttp

from edge_sdk import EdgeClient
from edge_sdk.drafters.torch import TorchDrafter


def _value(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + (("{" + labels) if labels else " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_what_the_client_saw(server, tok, draft):
    async def main():
        async with EdgeClient(server.url, TorchDrafter(draft), tok, depth=3, chat=False) as c:
            r = await c.generate(prompt_ids=[4, 5, 6], max_new_tokens=20)
        async with aiohttp.ClientSession() as http:
            async with http.get(server.url + "/metrics") as resp:
                assert resp.status == 200
                return r, await resp.text()

    r, text = asyncio.run(main())
    m = r.metrics
    assert _value(text, "specrelay_drafted_tokens_total") == m["drafted_tokens"]
    assert _value(text, "specrelay_accepted_tokens_total") == m["accepted_tokens"]
    assert _value(text, "specrelay_target_passes_total") == m["rounds"]
    assert _value(text, "specrelay_bonus_tokens_total") == m["bonus_tokens"]
    assert _value(text, "specrelay_batch_size_count") == m["rounds"]
    assert _value(text, "specrelay_requests_total",
                  'endpoint="POST /v1/sessions/{sid}/verify",status="200"') == m["rounds"]
    assert _value(text, "specrelay_body_bytes_total", 'direction="in"') >= m["uplink_bytes"]
    assert _value(text, "specrelay_sessions") == 0.0     # the client deleted its session


def test_classify_divergence_follows_the_near_tie_policy():
    from edge_sdk.metrics import classify_divergence, first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 2]) == 2           # shorter: at its end
    assert classify_divergence([1, 2, 3], [], [1, 2, 3], []) == (None, "identical")
    assert classify_divergence([1, 2, 3], [2], [1, 2, 4], []) == (2, "near_tie")
    assert classify_divergence([1, 2, 3], [], [1, 2, 4], [2]) == (2, "near_tie")
    assert classify_divergence([1, 2, 3], [0, 1], [1, 2, 4], [0]) == (2, "hard")


def test_near_tie_positions_past_the_committed_tokens_are_dropped():
    from edge_sdk.metrics import RequestMetrics

    m = RequestMetrics(committed_tokens=5, near_tie_positions=[1, 4, 5, 7])
    d = m.to_dict()
    assert d["near_tie_positions"] == [1, 4] and d["near_tie_tokens"] == 2


def test_metrics_on_their_own_listener(target, tok, draft):
    """``metrics_address``: /metrics leaves the API port (404 there) and answers on its
    own listener, counting the API's requests; the listener closes with the app."""
    import socket

    import requests

    from cloud_api.app import create_app
    from cloud_api.server import BackgroundServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        mport = s.getsockname()[1]
    murl = f"http://127.0.0.1:{mport}/metrics"
    with BackgroundServer(create_app(target, tok, metrics_address=("127.0.0.1", mport))) as srv:
        assert requests.get(srv.url + "/metrics", timeout=10).status_code == 404
        async def main():
            async with EdgeClient(srv.url, TorchDrafter(draft), tok, depth=3,
                                  chat=False) as c:
                return await c.generate(prompt_ids=[4, 5, 6], max_new_tokens=12)
        r = asyncio.run(main())
        text = requests.get(murl, timeout=10).text
        assert _value(text, "specrelay_target_passes_total") == r.metrics["rounds"]
        assert _value(text, "specrelay_sessions") == 0.0
    try:
        requests.get(murl, timeout=2)
        raise AssertionError("the metrics listener outlived the app")
    except requests.ConnectionError:
        pass
