"""Scale-out bench: the same concurrent target-only load through one embedded server
and through the Ray ingress over 1 and 2 verifier replicas on Ray Serve
(:mod:`cloud_api.replicas`).

Each of C clients generates N greedy tokens with the target alone (blocks of depth 0:
one verify request per token, the heaviest request rate per token), every client's
output compared with the embedded server's. Reported per setup: wall seconds,
aggregate tokens/s, client-side verify latency p50/p99 (ms), and the outputs' identity.

On a 2-core machine the replicas share the cores with the ingress and the clients, so
1 vs 2 replicas shows the Ray path's overhead, not scaling: scaling needs a replica
per machine (or per GPU).

    specrelay bench --scale-out --out bench-out     # tiny model, 1 vs 2 replicas at 16
    python -m bench.replicas --concurrency 16 --tokens 24 --out /tmp/replicas.json
    python -m bench.replicas --model smollm2-135m --concurrency 16 --tokens 16

:func:`write_report` writes ``replicas.json`` (rows + :data:`NOTE`) and
``replicas.png`` (tokens/s and verify latency per setup).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import click
import numpy as np

__all__ = ["NOTE", "tiny_pair", "run", "write_report"]

NOTE = ("the replicas share this machine's {cpus} CPU(s) with the ingress and the "
        "clients: 1 vs 2 replicas shows the Ray path's overhead, not scaling (scaling "
        "needs a replica per machine or per GPU)")


def tiny_pair(vocab: int = 64, layers: int = 2, hidden: int = 32, seed: int = 0):
    """A random tiny Llama and a word-level tokenizer (the tests' kind of model; each
    replica builds the same one from the seed)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = {"<eos>": 0, "<unk>": 1} | {f"w{i}": i for i in range(2, vocab)}
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, eos_token_id=0, bos_token_id=1,
                      pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    model.generation_config.eos_token_id = 0
    return model, tok


async def _clients(url: str, tok, prompts: list[list[int]], n: int) -> dict:
    """C concurrent target-only generations: wall s, tokens, verify latencies (s)."""
    from bench.loadtest import TimedTransport
    from edge_sdk import EdgeClient
    from edge_sdk.transport import Transport

    lat: list[float] = []

    async def one(p):
        async with EdgeClient(url, None, tok, chat=False,
                              transport=TimedTransport(Transport(url), lat)) as c:
            return (await c.generate(prompt_ids=p, max_new_tokens=n,
                                     target_only=True)).token_ids

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(p) for p in prompts))
    return {"wall_s": time.perf_counter() - t0, "outputs": outs, "latencies": lat}


def _row(name: str, got: dict, ref: list | None) -> dict:
    lat = np.array(got["latencies"]) * 1000
    toks = sum(len(o) for o in got["outputs"])
    return {"setup": name, "wall_s": round(got["wall_s"], 3), "tokens": toks,
            "throughput_tok_s": round(toks / got["wall_s"], 1),
            "verify_p50_ms": round(float(np.percentile(lat, 50)), 2),
            "verify_p99_ms": round(float(np.percentile(lat, 99)), 2),
            "identical": ref is None or got["outputs"] == ref}


def _embedded(target, prompts, n) -> dict:
    from cloud_api.app import create_app
    from cloud_api.server import BackgroundServer
    from cloud_api.replicas.replica import load_target

    model, tok = load_target(target, threads=1)
    with BackgroundServer(create_app(model, tok, max_batch=16, threads=1)) as srv:
        asyncio.run(_clients(srv.url, tok, prompts[:1], 2))             # warm-up
        return asyncio.run(_clients(srv.url, tok, prompts, n)), tok


def _replicated(target, k: int, tok, prompts, n) -> dict:
    from cloud_api.replicas import cluster
    from cloud_api.replicas.ingress import create_replicated_app
    from cloud_api.server import BackgroundServer

    app = f"bench-{k}"
    client, info = cluster.start_replicas(target, k, app=app, num_cpus=0, threads=1,
                                          max_batch=16)
    try:
        with BackgroundServer(create_replicated_app(client, info)) as srv:
            asyncio.run(_clients(srv.url, tok, prompts[:1], 2))         # warm-up
            return asyncio.run(_clients(srv.url, tok, prompts, n))
    finally:
        cluster.stop_replicas(app)


def run(target, concurrency: int, n: int, replicas=(1, 2)) -> list[dict]:
    """Rows: embedded, then each replica count (module doc)."""
    from cloud_api.replicas import cluster

    prompts = [[2 + (i * 7) % 60, 3 + i % 50, 5] for i in range(concurrency)]
    import ray

    emb, tok = _embedded(target, prompts, n)
    rows = [_row("embedded", emb, None)]
    started = not ray.is_initialized()
    cluster.connect(num_cpus=os.cpu_count())
    try:
        for k in replicas:
            rows.append(_row(f"ray x{k}", _replicated(target, k, tok, prompts, n),
                             emb["outputs"]))
    finally:
        if started:                     # the local cluster ends with the run
            cluster.shutdown()
    return rows


def write_report(rows: list[dict], out_dir: str, meta: dict) -> list[str]:
    """``OUT/replicas.json`` (``meta``, the rows, the note) and ``OUT/replicas.png``
    (aggregate tokens/s and verify p50/p99 in ms per setup). Returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    js, png = os.path.join(out_dir, "replicas.json"), os.path.join(out_dir, "replicas.png")
    with open(js, "w") as f:
        json.dump({**meta, "cpus": os.cpu_count(),
                   "note": NOTE.format(cpus=os.cpu_count()), "rows": rows}, f, indent=1)
    _plot(rows, png, f"{meta.get('model')}: {meta.get('concurrency')} concurrent clients "
          f"x {meta.get('tokens')} tokens, {os.cpu_count()} CPUs")
    return [js, png]


def _plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["setup"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.bar(names, [r["throughput_tok_s"] for r in rows], color="tab:blue")
    a.set_ylabel("tokens/s (all clients)")
    x = np.arange(len(rows))
    b.bar(x - 0.2, [r["verify_p50_ms"] for r in rows], 0.4, label="p50")
    b.bar(x + 0.2, [r["verify_p99_ms"] for r in rows], 0.4, label="p99")
    b.set_xticks(x, names)
    b.set_ylabel("verify latency (ms)")
    b.legend()
    fig.suptitle(title + " (overhead, not scaling, on one machine)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict], echo=click.echo) -> None:
    """The rows as a markdown table, then :data:`NOTE`."""
    echo("| setup | wall s | tok/s | verify p50 ms | verify p99 ms | identical |")
    echo("|---|---|---|---|---|---|")
    for r in rows:
        echo(f"| {r['setup']} | {r['wall_s']} | {r['throughput_tok_s']} | "
             f"{r['verify_p50_ms']} | {r['verify_p99_ms']} | {r['identical']} |")
    echo("note: " + NOTE.format(cpus=os.cpu_count()))


@click.command()
@click.option("--model", default="tiny", show_default=True,
              help="Target: `tiny` (random, seconds) or a model spec (preset, path).")
@click.option("--concurrency", type=click.IntRange(1), default=16, show_default=True)
@click.option("--tokens", type=click.IntRange(1), default=24, show_default=True)
@click.option("--replicas", default="1,2", show_default=True, help="Replica counts.")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="JSON rows.")
def main(model, concurrency, tokens, replicas, out):
    """Embedded vs Ray replicas under C concurrent target-only clients."""
    target = tiny_pair if model == "tiny" else model
    rows = run(target, concurrency, tokens, [int(x) for x in replicas.split(",")])
    print_table(rows)
    if out:
        with open(out, "w") as f:
            json.dump({"model": model, "concurrency": concurrency, "tokens": tokens,
                       "cpus": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
