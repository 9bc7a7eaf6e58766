"""Soak / load test of the signed verification API (not a CI test).

N concurrent signed sessions generate for a fixed duration against one in-process
server (request signing and per-key rate limits on), through the user-space link
emulator, each session cycling through a mix of sampling configs:

* greedy: every output is compared with the target-alone reference of its prompt; a
  difference at a near-tie of the target's logits (``bench.report`` policy) is counted
  apart from a hard mismatch (a bug);
* seeded sampling (``--sampled``): every output must equal the first output of the same
  (prompt, config, seed) — a seeded request replays exactly, under any load and batching.

Every 10 s the process RSS is sampled (``rss.png``: the curve); at the end the test
counts open file descriptors and live asyncio tasks (client and server loop) against
their values before the load, and reports the RSS growth after warm-up (the first 10 %
of the run, at least 30 s). Client-side verify latencies give p50/p99.

    python -m bench.loadtest --duration 1800 --concurrency 32 --out /tmp/soak
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import click
import numpy as np

SAMPLED = ({"temperature": 0.8, "top_p": 0.95}, {"temperature": 1.0, "top_k": 20})


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


def _open_fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


def _jobs(n_prompts: int, sampled: bool) -> list[tuple[int, dict | None, int]]:
    """The request mix: ``(prompt index, sampling dict or None = greedy, seed)``."""
    jobs = [(k, None, 0) for k in range(n_prompts)]
    if sampled:
        jobs += [(k, SAMPLED[k % len(SAMPLED)], 100 + k) for k in range(n_prompts)]
    return jobs


class Checker:
    """Compares each output with its reference (greedy) or its first replay (sampled)."""

    def __init__(self, refs: dict):
        self.refs, self.first = refs, {}
        self.stats = {"generations": 0, "tokens": 0, "errors": 0, "mismatches": 0,
                      "near_tie_divergences": 0, "replay_mismatches": 0}

    def check(self, job, res) -> None:
        from edge_sdk.metrics import classify_divergence

        s = self.stats
        s["generations"] += 1
        s["tokens"] += len(res.token_ids)
        k, sampling, _seed = job
        if sampling is None:
            ref = self.refs[k]
            if res.token_ids != ref.token_ids:
                _, kind = classify_divergence(
                    ref.token_ids, ref.metrics.get("near_tie_positions", []),
                    res.token_ids, res.metrics.get("near_tie_positions", []))
                s["near_tie_divergences" if kind == "near_tie" else "mismatches"] += 1
            return
        first = self.first.setdefault((k, json.dumps(sampling, sort_keys=True), _seed),
                                      res.token_ids)
        s["replay_mismatches"] += first != res.token_ids


async def _worker(w, url, signer, drafter, tok, prompts, jobs, checker, lat, stop_at,
                  max_new, depth, concurrency):
    from edge_sdk import EdgeClient, SamplingConfig
    from edge_sdk.transport import Transport

    transport = TimedTransport(Transport(url, signer=signer, retries=8), lat)
    async with EdgeClient(url, drafter.fork(), tok, depth=depth, controller="fixed",
                          chat=False,
                          transport=transport, proactive="ipdg", send_ahead=True) as c:
        i = w
        while time.monotonic() < stop_at:
            job = jobs[i % len(jobs)]
            i += concurrency
            k, sampling, seed = job
            try:
                r = await c.generate(prompt_ids=prompts[k], max_new_tokens=max_new,
                                     sampling=SamplingConfig.from_dict(sampling),
                                     seed=seed)
            except Exception:  # noqa: BLE001 - counted and reported
                checker.stats["errors"] += 1
                continue
            checker.check(job, r)


async def _sample_rss(stop_at: float, curve: list, every_s: float = 10.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() < stop_at:
        curve.append((round(time.monotonic() - t0, 1), _rss_mb()))
        await asyncio.sleep(min(every_s, max(0.0, stop_at - time.monotonic())))
    curve.append((round(time.monotonic() - t0, 1), _rss_mb()))


async def _run(url, signer, drafter, tok, prompts, jobs, refs, concurrency, duration,
               max_new, depth) -> dict:
    lat: list[float] = []
    checker = Checker(refs)
    curve: list = []
    stop_at = time.monotonic() + duration
    await asyncio.gather(_sample_rss(stop_at, curve), *(
        _worker(w, url, signer, drafter, tok, prompts, jobs, checker, lat, stop_at,
                max_new, depth, concurrency) for w in range(concurrency)))
    await asyncio.sleep(0.5)                            # let closed connections settle
    lat_ms = np.array(lat) * 1000
    return {**checker.stats, "verify_requests": len(lat),
            "verify_p50_ms": float(np.percentile(lat_ms, 50)) if lat else None,
            "verify_p99_ms": float(np.percentile(lat_ms, 99)) if lat else None,
            "client_tasks_left": len(asyncio.all_tasks()) - 1, "rss_curve": curve}


def _server_tasks(srv) -> int:
    """Live asyncio tasks on the in-process server's loop (its serving tasks)."""
    async def count():
        return len(asyncio.all_tasks()) - 1
    return asyncio.run_coroutine_threadsafe(count(), srv.server.loop).result(10)


def rss_summary(curve: list, duration: float) -> dict:
    """Start / after-warm-up / max / end RSS (MB) and the growth after warm-up (the
    first 10 % of the run, at least 30 s) as a fraction."""
    warm_s = max(30.0, 0.1 * duration)
    after = [mb for t, mb in curve if t >= warm_s] or [curve[-1][1]]
    return {"rss_mb_start": curve[0][1], "rss_mb_after_warmup": after[0],
            "rss_mb_max": max(mb for _, mb in curve), "rss_mb_end": curve[-1][1],
            "rss_growth_after_warmup": (curve[-1][1] - after[0]) / after[0]}


def plot_rss(curve: list, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([t / 60 for t, _ in curve], [mb for _, mb in curve], marker=".")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MB), client + server process")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _references(url, signer, tok, prompts, max_new) -> dict:
    from edge_sdk import EdgeClient

    async def go():
        async with EdgeClient(url, None, tok, chat=False, signer=signer) as c:
            return {k: await c.generate(prompt_ids=p, max_new_tokens=max_new)
                    for k, p in enumerate(prompts)}
    return asyncio.run(go())


def soak(target, draft, n_prompts, concurrency, duration, max_new, depth, rpm, profile,
         sampled) -> dict:
    """Load the models, serve, run the load through the link emulator; the report."""
    from bench.linkem import LinkEmulatorThread
    from specrelay_data.workloads import load_workload
    from cloud_api.local import local_server
    from edge_sdk.drafters.torch import TorchDrafter
    from edge_sdk.models import encode_prompt, load_model

    tmodel, tok = load_model(target)
    dmodel, _ = load_model(draft)
    prompts = [encode_prompt(tok, p.text, True) for p in load_workload("mtbench", n_prompts)]
    with local_server(tmodel, tok, name="loadtest", rpm=rpm, max_batch=16) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        with LinkEmulatorThread("127.0.0.1", port, profile) as link:
            url = f"http://{link.host}:{link.port}"
            refs = _references(url, srv.signer, tok, prompts, max_new)
            fds0, tasks0 = _open_fds(), _server_tasks(srv)
            t0 = time.perf_counter()
            rep = asyncio.run(_run(url, srv.signer, TorchDrafter(dmodel), tok, prompts,
                                   _jobs(n_prompts, sampled), refs, concurrency, duration,
                                   max_new, depth))
            rep["wall_s"] = time.perf_counter() - t0
            time.sleep(1.0)
            rep["fds_leaked"] = _open_fds() - fds0
            rep["server_tasks_leaked"] = _server_tasks(srv) - tasks0
    rep.update(rss_summary(rep["rss_curve"], duration))
    return rep


@click.command()
@click.option("--duration", default=300.0, show_default=True, help="seconds")
@click.option("--concurrency", default=32, show_default=True)
@click.option("--target", default="smollm2-135m", show_default=True)
@click.option("--draft", default="smollm2-135m-draft", show_default=True)
@click.option("--prompts", "n_prompts", default=8, show_default=True)
@click.option("--max-new-tokens", default=32, show_default=True)
@click.option("--depth", default=4, show_default=True)
@click.option("--rpm", default=60_000, show_default=True, help="per-key requests/min")
@click.option("--profile", default="medium", show_default=True,
              help="link-emulator profile between the clients and the server")
@click.option("--sampled/--greedy-only", default=True, show_default=True,
              help="add seeded sampling configs to the mix (checked for exact replay)")
@click.option("--out", default=None, help="folder for soak.json and rss.png")
def main(duration, concurrency, target, draft, n_prompts, max_new_tokens, depth, rpm,
         profile, sampled, out):
    """Run the soak and print a JSON report (the RSS curve in rss.png with --out)."""
    rep = soak(target, draft, n_prompts, concurrency, duration, max_new_tokens, depth, rpm,
               profile, sampled)
    rep["config"] = {"duration_s": duration, "concurrency": concurrency, "target": target,
                     "draft": draft, "rpm": rpm, "max_new_tokens": max_new_tokens,
                     "depth": depth, "profile": profile, "sampled": sampled,
                     "prompts": n_prompts}
    text = json.dumps(rep, indent=1)
    click.echo(json.dumps({k: v for k, v in rep.items() if k != "rss_curve"}, indent=1))
    if out:
        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "soak.json").write_text(text)
        plot_rss(rep["rss_curve"], d / "rss.png",
                 f"soak: {concurrency} sessions, {duration / 60:.0f} min, {profile} link")


if __name__ == "__main__":
    main()
