"""Loopback load test of the signed verification API (not a CI test).

N concurrent signed sessions generate for a fixed duration against one server with rate
limits on. Every greedy output is compared with the target-alone reference of its
prompt (no lost or duplicated tokens), the process RSS is sampled (memory bounded) and
client-side verify latencies give p50/p99.

    python -m bench.loadtest --duration 300 --concurrency 32
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import click
import numpy as np


class TimedTransport:
    """Wraps a Transport; records the latency (seconds) of every verify request."""

    def __init__(self, inner, sink: list):
        self.inner, self.sink = inner, sink

    async def request(self, method, path, body=b"", content_type="application/x-msgpack"):
        t0 = time.perf_counter()
        out = await self.inner.request(method, path, body, content_type)
        if path.endswith("/verify"):
            self.sink.append(time.perf_counter() - t0)
        return out

    async def close(self):
        await self.inner.close()


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _run(url, signer, drafter, tok, prompts, refs, concurrency, duration, max_new,
               depth):
    from edge_sdk import EdgeClient
    from edge_sdk.transport import Transport

    lat: list[float] = []
    stats = {"generations": 0, "mismatches": 0, "tokens": 0, "errors": 0}
    rss = [_rss_mb()]
    stop_at = time.monotonic() + duration

    async def worker(w: int):
        transport = TimedTransport(Transport(url, signer=signer, retries=8), lat)
        async with EdgeClient(url, drafter.fork(), tok, depth=depth, chat=False,
                              transport=transport) as c:
            i = w
            while time.monotonic() < stop_at:
                k = i % len(prompts)
                i += concurrency
                try:
                    r = await c.generate(prompt_ids=prompts[k], max_new_tokens=max_new)
                except Exception:  # noqa: BLE001 - counted and reported
                    stats["errors"] += 1
                    continue
                stats["generations"] += 1
                stats["tokens"] += len(r.token_ids)
                stats["mismatches"] += r.token_ids != refs[k]

    async def sampler():
        while time.monotonic() < stop_at:
            rss.append(_rss_mb())
            await asyncio.sleep(2.0)

    await asyncio.gather(sampler(), *(worker(w) for w in range(concurrency)))
    lat_ms = np.array(lat) * 1000
    return {**stats, "verify_requests": len(lat),
            "verify_p50_ms": float(np.percentile(lat_ms, 50)) if lat else None,
            "verify_p99_ms": float(np.percentile(lat_ms, 99)) if lat else None,
            "rss_mb_start": rss[0], "rss_mb_max": max(rss), "rss_mb_end": rss[-1]}


@click.command()
@click.option("--duration", default=300.0, show_default=True, help="seconds")
@click.option("--concurrency", default=32, show_default=True)
@click.option("--target", default="qwen2.5-coder-1.5b", show_default=True)
@click.option("--draft", default="qwen2.5-coder-0.5b", show_default=True)
@click.option("--prompts", "n_prompts", default=8, show_default=True)
@click.option("--max-new-tokens", default=32, show_default=True)
@click.option("--depth", default=4, show_default=True)
@click.option("--rpm", default=60_000, show_default=True, help="per-key requests/min")
@click.option("--out", default=None, help="write the JSON report here")
def main(duration, concurrency, target, draft, n_prompts, max_new_tokens, depth, rpm, out):
    """Run the load test and print a JSON report."""
    from bench.workloads import load_workload
    from cloud_api.local import local_server
    from edge_sdk import EdgeClient
    from edge_sdk.drafters.torch import TorchDrafter
    from edge_sdk.models import encode_prompt, load_model

    tmodel, tok = load_model(target)
    dmodel, _ = load_model(draft)
    prompts = [encode_prompt(tok, p.text, True) for p in load_workload("mtbench", n_prompts)]
    with local_server(tmodel, tok, name="loadtest", rpm=rpm, max_batch=16) as srv:
        signer = srv.signer
        async def refs():
            async with EdgeClient(srv.url, None, tok, chat=False, signer=signer) as c:
                return [(await c.generate(prompt_ids=p, max_new_tokens=max_new_tokens))
                        .token_ids for p in prompts]

        references = asyncio.run(refs())
        t0 = time.perf_counter()
        report = asyncio.run(_run(srv.url, signer, TorchDrafter(dmodel), tok, prompts,
                                  references, concurrency, duration, max_new_tokens, depth))
        report["wall_s"] = time.perf_counter() - t0
        report["config"] = {"duration_s": duration, "concurrency": concurrency,
                            "target": target, "draft": draft, "rpm": rpm,
                            "max_new_tokens": max_new_tokens, "depth": depth}
    text = json.dumps(report, indent=2)
    click.echo(text)
    if out:
        with open(out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
