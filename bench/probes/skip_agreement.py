"""Top-1 agreement of a layer-skipping self-speculative draft with the full target,
against the early exit (tuned lens) at the same resident-layer count (issue #17).

    python -m bench.probes.skip_agreement [--prompts 4] [--tokens 32] [--fit 10]

The skip draft of split ``(R1, R2)`` runs decoder layers ``0..R1-1`` and
``L-R2..L-1`` (the middle ``R1..L-R2-1`` skipped) and the model's own final norm + LM
head (Draft & Verify, Zhang et al. 2023, §3.1: self-speculative drafting by skipping
intermediate layers; LayerSkip, Elhoushi et al. 2024, §4; SWIFT, Xia et al. 2024).
The early exit runs layers ``0..E-1`` and the tuned lens at ``E`` (Belrose et al.
2023, §3), fitted here in closed form (:func:`edge_sdk.exit_head.fit_translator`) on
the held-out calibration text the bench uses (:func:`cloud_api.exit_fit.calibration_text`).

Everything is teacher-forced on the full target's greedy continuation (bf16, one
thread) of the bench's first ``--prompts`` HumanEval and MT-Bench prompts. For each
predicted position ``p`` (the prompt's last token .. the continuation's last but one):

* ``a1`` (true prefix KV): the draft's query at ``p`` attends to the TRUE keys/values
  of positions ``< p`` in the last R2 layers (what a decoder gets that keeps the full
  model's cache for the prefix and crops the draft's own entries before verification)
  and to its own skip-path entry. One batched pass per split: the rows are appended
  after the full sequence's true cache with their own position ids and a mask
  (cache rows ``[0, p)`` + the row itself), then the cache is cropped back.
* ``own``: the draft keeps its OWN keys/values of the last R2 layers for the whole
  sequence (the skip path run over prompt and continuation with a fresh cache).
* ``acc@D``: blocks of depth ``D`` (default 8) started at every position: block rows
  ``j = 0..D-1`` attend to the true prefix before the block and to the block's own
  skip-path rows ``0..j``, exactly the cache a CATS round drafts against (the last
  confirmed token is row 0). ``acc@D`` is the mean number of leading drafts that equal
  the target's tokens, i.e. the chain's accepted length (tokens per streamed pass =
  acc@D + 1 without an early stop).

The early exit's layers are the target's own, so its rows are independent; its
``acc@D`` is computed from the same per-position hits.
Output: a markdown table on stdout (and ``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import time

SPLITS = {12: [(2, 10), (4, 8), (6, 6), (8, 4), (10, 2)],
          14: [(2, 12), (3, 11), (4, 10), (6, 8), (8, 6), (10, 4), (12, 2)],
          21: [(4, 17), (7, 14), (10, 11), (13, 8), (16, 5), (19, 2)],
          28: [(14, 14)]}
"""Resident-layer count R -> (R1, R2) splits measured (28: nothing skipped, the check
that the batched masks reproduce the full target: agreement ~1)."""


def _prompts(tok, n: int) -> list[tuple[str, list[int]]]:
    """The bench's first ``n`` prompts per workload, encoded as the bench encodes them."""
    from bench.cells import encode_requests
    from specrelay_data.workloads import load_workload

    out = []
    for w in ("humaneval", "mtbench"):
        out += [(w, list(r.prompt_ids)) for r in encode_requests(tok, load_workload(w)[:n], w, 0)]
    return out


def _greedy(t, prompt: list[int], n: int) -> list[int]:
    """The full target's greedy continuation of ``prompt`` (``n`` tokens)."""
    t.reset()
    lg = t.forward(prompt)[-1]
    out = [int(lg.argmax())]
    while len(out) < n:
        out.append(int(t.forward([out[-1]])[0].argmax()))
    return out


def _block_rows(n_pred: int, D: int, p0: int, N: int):
    """Rows of the batched skip pass for blocks of depth ``D`` at every start
    ``s <= n_pred - D``: (prediction index per row, position ids long [1, M],
    mask bool [1, 1, M, N + M]) with ``p0`` the first predicted position and ``N``
    the true cache length."""
    import torch

    starts = range(0, n_pred - D + 1)
    idx = [s + j for s in starts for j in range(D)]
    M = len(idx)
    mask = torch.zeros(M, N + M, dtype=torch.bool)
    for r, (s, j) in enumerate((s, j) for s in starts for j in range(D)):
        mask[r, : p0 + s] = True                       # true prefix before the block
        mask[r, N + r - j: N + r + 1] = True           # the block's own rows 0..j
    pos = torch.tensor([[p0 + i for i in idx]], dtype=torch.long)
    return idx, pos, mask[None, None]


def _leading(hits: list[bool]) -> int:
    n = 0
    for h in hits:
        if not h:
            break
        n += 1
    return n


def main(argv=None) -> dict:
    import torch
    from transformers import AutoConfig, DynamicCache

    from cloud_api.exit_fit import calibration_text
    from edge_sdk.exit_head import ExitHead, fit_translator, restricted_vocab
    from edge_sdk.local_target.load import checkpoint_dir
    from edge_sdk.local_target.runner import OffloadedTarget
    from edge_sdk.local_target.storage import PROFILES, Storage
    from edge_sdk.models import load_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--fit", type=int, default=10, help="calibration sequences per workload")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    folder = checkpoint_dir(a.target, "bfloat16")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    L = int(config.num_hidden_layers)
    t = OffloadedTarget(Storage(folder / "model.safetensors", PROFILES["ram"]), config, L,
                        torch.bfloat16, resident_embed=True)
    tok = load_tokenizer(a.target)
    exits = [E for E in sorted(SPLITS) if E < L]

    # tuned lens at each exit layer, fitted on held-out calibration text
    xs, ys = {E: [] for E in exits}, []
    for s in calibration_text(tok, a.fit, a.fit, 256):
        t.reset()
        h, i0 = t.embed(s), 0
        for E in exits:
            h = t.run_layers(h, i0, E)
            xs[E].append(h[0].float())
            i0 = E
        ys.append(t.run_layers(h, i0, L)[0].float())
    vocab = restricted_vocab(t.model, 32768)
    heads = {}
    for E in exits:
        w, b = fit_translator(torch.cat(xs[E]), torch.cat(ys), 1e-2)
        heads[E] = ExitHead(t.model, E, weight=w, bias=b, vocab_ids=vocab, name=f"tuned-L{E}")
    del xs, ys
    print(f"# heads fitted ({time.perf_counter() - t0:.0f} s)", flush=True)

    D, n = a.depth, a.tokens
    names = ([f"exit@{E}" for E in exits] + [f"lens@{E}" for E in exits]
             + [f"skip {r1}+{r2}" for E in SPLITS for r1, r2 in SPLITS[E]])
    hits = {k: {"a1": [], "own": [], "acc": []} for k in names}
    for w, prompt in _prompts(tok, a.prompts):
        cont = _greedy(t, prompt, n)
        seq = prompt + cont[:-1]
        N, p0 = len(seq), len(prompt) - 1
        t.reset()
        hs, h = [t.embed(seq)], t.embed(seq)
        for i in range(L):
            h = t.run_layers(h, i, i + 1)
            hs.append(h)                                            # hs[i]: input of layer i
        ref = t.logits(hs[L])[p0:].argmax(-1)                        # [n] the target's tokens
        for E in exits:
            for kind, head in (("exit", heads[E]), ("lens", ExitHead(t.model, E, vocab_ids=vocab))):
                hit = (head.logits(hs[E][0, p0:]).argmax(-1) == ref).tolist()
                k = f"{kind}@{E}"
                hits[k]["a1"] += hit
                hits[k]["own"] += hit
                hits[k]["acc"] += [_leading(hit[s:s + D]) for s in range(n - D + 1)]
        idx, pos, mask = _block_rows(n, D, p0, N)
        for E in SPLITS:
            for r1, r2 in SPLITS[E]:
                k = f"skip {r1}+{r2}"
                x = hs[r1][:, p0:]
                # a1: one row per position against the true prefix
                m1 = torch.zeros(n, N + n, dtype=torch.bool)
                for j in range(n):
                    m1[j, : p0 + j] = True
                    m1[j, N + j] = True
                out = t.run_layers(x, L - r2, L, torch.arange(p0, p0 + n)[None], m1[None, None])
                t.crop(N)
                hits[k]["a1"] += (t.logits(out).argmax(-1) == ref).tolist()
                # own: the skip path's own cache over the whole sequence
                keep, t.cache = t.cache, DynamicCache(config=config)
                out = t.run_layers(hs[r1], L - r2, L)
                t.cache = keep
                hits[k]["own"] += (t.logits(out[:, p0:]).argmax(-1) == ref).tolist()
                # acc@D: depth-D blocks at every start
                out = t.run_layers(x[:, idx], L - r2, L, pos, mask)
                t.crop(N)
                hb = (t.logits(out).argmax(-1) == ref[idx]).tolist()
                hits[k]["acc"] += [_leading(hb[r:r + D]) for r in range(0, len(hb), D)]
        print(f"# {w} prompt of {len(prompt)} tokens done ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    rows = {k: {"a1": sum(v["a1"]) / len(v["a1"]), "own": sum(v["own"]) / len(v["own"]),
                f"acc@{D}": sum(v["acc"]) / len(v["acc"]), "n": len(v["a1"])}
            for k, v in hits.items()}
    print(f"\n| draft | resident layers | top-1 agreement (true prefix KV) | "
          f"own-KV agreement | accepted per depth-{D} block |")
    print("|---|---|---|---|---|")
    for k, r in rows.items():
        R = int(k.split("@")[1]) if "@" in k else sum(map(int, k.split()[1].split("+")))
        print(f"| {k} | {R} | {r['a1']:.3f} | {r['own']:.3f} | {r[f'acc@{D}']:.2f} |")
    print(f"\n{rows[names[0]]['n']} positions; {time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
