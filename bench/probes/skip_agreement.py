"""Top-1 agreement of a layer-skipping self-speculative draft with the full target,
against the early exit (tuned lens) at the same resident-layer count (CATS).

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

Variants: ``--translate`` adds ``skip+T``, the skip draft with an affine map from the
residual stream at ``R1`` to the one at ``L-R2`` fitted on the calibration text
(:func:`fit_skip_translator`); ``--prefix-only`` makes the block rows attend in the
tail layers to the true prefix and themselves only. Both measured worse than the plain
skip draft (docs/figures/cats/skip/translator.md, prefix_only.md). ``--sublayer`` adds
``attn R1+R2``: the middle layers ``R1..L-R2-1`` skip only their MLP sublayer, their
attention runs (resident: 11 MB a layer against the MLP's 83 MB, so the attention of
all 18 middle layers of a 2+8 split costs about the two full layers a 2+10 split
has more; SWIFT, Xia et al. 2024, §3 and Draft & Verify, Zhang et al. 2023, §3.1 skip
attention and MLP sublayers separately). Their block rows attend, like the tail's, to
the middle layers' TRUE prefix entries and the block's own draft-only rows (cropped
before verification in a decoder). ``--no-exit`` skips the exit heads.
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


def _prompts(tok, n: int, offset: int = 0) -> list[tuple[str, list[int]]]:
    """The bench's prompts ``offset..offset+n-1`` per workload (0: its first ``n``, the
    ones the bench runs), encoded as the bench encodes them."""
    from bench.cells import encode_requests
    from specrelay_data.workloads import load_workload

    out = []
    for w in ("humaneval", "mtbench"):
        out += [(w, list(r.prompt_ids)) for r in encode_requests(tok, load_workload(w)[offset:offset + n], w, 0)]
    return out


def _greedy(t, prompt: list[int], n: int) -> list[int]:
    """The full target's greedy continuation of ``prompt`` (``n`` tokens)."""
    t.reset()
    lg = t.forward(prompt)[-1]
    out = [int(lg.argmax())]
    while len(out) < n:
        out.append(int(t.forward([out[-1]])[0].argmax()))
    return out


def _block_rows(n_pred: int, D: int, p0: int, N: int, prefix_only: bool = False):
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
        mask[r, N + (r if prefix_only else r - j): N + r + 1] = True   # own rows 0..j
    pos = torch.tensor([[p0 + i for i in idx]], dtype=torch.long)
    return idx, pos, mask[None, None]


def fit_skip_translator(X, Y, ridge: float = 1e-3):
    """Affine map ``Y ~ X @ w + b`` from the residual stream at ``R1`` to the one at
    ``L-R2`` (both [N, H]), by ridge least squares with rows weighted by 1/RMS(x)^2
    (the attention sink's massive activations would dominate; cf.
    :func:`edge_sdk.exit_head.fit_translator`, which also normalises Y because a final
    norm follows; here the tail layers' residual additions need Y's scale). float64
    solve; returns float32 ``w`` [H, H], ``b`` [H]."""
    import torch

    X, Y = X.double(), Y.double()
    s = X.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
    Xa = torch.cat([X, torch.ones_like(s)], 1) / s
    gram = Xa.T @ Xa
    gram.diagonal()[:-1].add_(ridge * float(gram.diagonal()[:-1].mean()))
    wb = torch.linalg.solve(gram, Xa.T @ (Y / s))
    return wb[:-1].float(), wb[-1].float()


def attention_only(t, h, a: int, b: int, pos, mask):
    """Layers ``a..b-1`` of ``t`` on ``h`` [1, q, H] with only their attention sublayer
    (``h + attn(norm(h))``; the MLP sublayer skipped), writing their caches (draft-only
    entries). ``pos`` long [1, q], ``mask`` bool [1, 1, q, P + q]. Returns [1, q, H]."""
    pe = t.model.model.rotary_emb(h, pos)
    for i in range(a, b):
        lay = t.layer(i)
        o, _ = lay.self_attn(hidden_states=lay.input_layernorm(h), position_embeddings=pe,
                             attention_mask=mask, cache=t.cache, use_cache=True)
        h = h + o
    return h


def _sublayer_rows(t, x, r1: int, m: int, L: int, n: int, N: int, idx, pos, mask, ref,
                   out: dict, D: int) -> None:
    """``a1`` and ``acc@D`` of the split ``r1 + (L - m)`` with the middle ``r1..m-1``
    run attention-only (their rows, like the tail's, against the true prefix entries);
    ``own`` is not measured (recorded as ``a1``). ``x`` [1, n, H] at layer ``r1``."""
    import torch

    m1 = torch.zeros(n, N + n, dtype=torch.bool)
    p0 = N - n                                   # the prompt's last token
    for j in range(n):
        m1[j, : p0 + j] = True
        m1[j, N + j] = True
    p1 = torch.arange(p0, p0 + n)[None]
    h = attention_only(t, x, r1, m, p1, m1[None, None])
    h = t.run_layers(h, m, L, p1, m1[None, None])
    t.crop(N)
    hit = (t.logits(h).argmax(-1) == ref).tolist()
    out["a1"] += hit
    out["own"] += hit
    h = attention_only(t, x[:, idx], r1, m, pos, mask)
    h = t.run_layers(h, m, L, pos, mask)
    t.crop(N)
    hb = (t.logits(h).argmax(-1) == ref[idx]).tolist()
    out["acc"] += [accepted_run(hb[r:r + D]) for r in range(0, len(hb), D)]


def parse_layers(text: str) -> list[int]:
    """``"0-2,17-24,26"`` -> the sorted layer ids. Raises ValueError for bad syntax."""
    out = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def accepted_run(hits: list[bool]) -> int:
    """Leading ``True`` entries of ``hits`` (per-position draft == target matches): the
    tokens a chain verifier accepts from a block with these matches."""
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
    from edge_sdk.local_target.skip import layer_ranges
    from edge_sdk.local_target.storage import PROFILES, Storage
    from edge_sdk.models import load_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--offset", type=int, default=0,
                    help="first prompt index per workload (e.g. 4: select sets on prompts "
                         "the bench's first 4 do not include)")
    ap.add_argument("--fit", type=int, default=10, help="calibration sequences per workload")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--translate", action="store_true",
                    help="also the skip draft with an affine translator R1 -> L-R2")
    ap.add_argument("--only", default=None, help="comma list of R values to measure")
    ap.add_argument("--sublayer", default=None,
                    help="comma list of R1+R2 splits measured with the middle layers' "
                         "attention run (MLP skipped), e.g. 2+8,3+7")
    ap.add_argument("--no-exit", action="store_true", help="no exit heads (faster)")
    ap.add_argument("--sets", default=None,
                    help="semicolon list of resident layer sets measured as skip drafts "
                         "(R1 = the first layer not in the set, the tail = the rest), "
                         "e.g. '0-2,17-24,26;0-2,11,17-26'")
    ap.add_argument("--prefix-only", action="store_true",
                    help="acc@D with block rows attending in the tail layers to the true "
                         "prefix and themselves only (not to the block's earlier rows)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    folder = checkpoint_dir(a.target, "bfloat16")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    L = int(config.num_hidden_layers)
    t = OffloadedTarget(Storage(folder / "model.safetensors", PROFILES["ram"]), config, L,
                        torch.bfloat16, resident_embed=True, packed=True)  # bit-identical
    tok = load_tokenizer(a.target)
    splits = {R: v for R, v in SPLITS.items()
              if a.only is None or str(R) in a.only.split(",")}
    exits = [] if a.no_exit else [E for E in sorted(splits) if E < L]
    subs = [tuple(map(int, x.split("+"))) for x in a.sublayer.split(",")] if a.sublayer else []
    sets = [parse_layers(x) for x in a.sets.split(";")] if a.sets else []
    if a.sets and a.only is None:
        splits = {}                              # --sets alone: only the sets

    # tuned lens at each exit layer, fitted on held-out calibration text
    xs, ys, cal = {E: [] for E in exits}, [], {i: [] for i in range(L + 1)}
    for s in calibration_text(tok, a.fit, a.fit, 256) if exits or a.translate else ():
        t.reset()
        h = t.embed(s)
        for i in range(L):
            if i in xs:
                xs[i].append(h[0].float())
            if a.translate:
                cal[i].append(h[0, 1:])                              # not the sink
            h = t.run_layers(h, i, i + 1)
        ys.append(h[0].float())
    trans = {}
    if a.translate:
        for E in splits:
            for r1, r2 in splits[E]:
                if r1 + r2 < L:
                    trans[(r1, r2)] = fit_skip_translator(torch.cat(cal[r1]),
                                                          torch.cat(cal[L - r2]))
    del cal
    vocab = restricted_vocab(t.model, 32768)
    heads = {}
    for E in exits:
        w, b = fit_translator(torch.cat(xs[E]), torch.cat(ys), 1e-2)
        heads[E] = ExitHead(t.model, E, weight=w, bias=b, vocab_ids=vocab, name=f"tuned-L{E}")
    del xs, ys
    print(f"# heads fitted ({time.perf_counter() - t0:.0f} s)", flush=True)

    D, n = a.depth, a.tokens
    names = ([f"exit@{E}" for E in exits] + [f"lens@{E}" for E in exits]
             + [f"skip {r1}+{r2}" for E in splits for r1, r2 in splits[E]]
             + [f"skip+T {r1}+{r2}" for r1, r2 in trans]
             + [f"attn {r1}+{r2}" for r1, r2 in subs]
             + [f"set {layer_ranges(ls)}" for ls in sets])
    hits = {k: {"a1": [], "own": [], "acc": []} for k in names}
    for w, prompt in _prompts(tok, a.prompts, a.offset):
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
                hits[k]["acc"] += [accepted_run(hit[s:s + D]) for s in range(n - D + 1)]
        idx, pos, mask = _block_rows(n, D, p0, N, a.prefix_only)
        variants = [(f"skip {r1}+{r2}", r1, r2, None) for E in splits for r1, r2 in splits[E]]
        variants += [(f"skip+T {r1}+{r2}", r1, r2, wb) for (r1, r2), wb in trans.items()]
        variants += [(f"attn {r1}+{r2}", r1, r2, "attn") for r1, r2 in subs]
        for ls in sets:                          # (R1, the tail) of a resident set
            r1 = min(i for i in range(L + 1) if i not in ls)
            variants.append((f"set {layer_ranges(ls)}", r1, sorted(i for i in ls if i > r1),
                             None))
        for k, r1, r2, wb in variants:
            tail = r2 if isinstance(r2, list) else list(range(L - r2, L))
            if isinstance(wb, str):
                _sublayer_rows(t, hs[r1][:, p0:], r1, L - r2, L, n, N, idx, pos, mask,
                               ref, hits[k], D)
                continue
            hin = hs[r1] if wb is None else (hs[r1].float() @ wb[0] + wb[1]).to(hs[r1].dtype)
            x = hin[:, p0:]
            # a1: one row per position against the true prefix
            m1 = torch.zeros(n, N + n, dtype=torch.bool)
            for j in range(n):
                m1[j, : p0 + j] = True
                m1[j, N + j] = True
            out = t.run_list(x, tail, torch.arange(p0, p0 + n)[None], m1[None, None])
            t.crop(N)
            hits[k]["a1"] += (t.logits(out).argmax(-1) == ref).tolist()
            # own: the skip path's own cache over the whole sequence
            keep, t.cache = t.cache, DynamicCache(config=config)
            out = t.run_list(hin, tail)
            t.cache = keep
            hits[k]["own"] += (t.logits(out[:, p0:]).argmax(-1) == ref).tolist()
            # acc@D: depth-D blocks at every start
            out = t.run_list(x[:, idx], tail, pos, mask)
            t.crop(N)
            hb = (t.logits(out).argmax(-1) == ref[idx]).tolist()
            hits[k]["acc"] += [accepted_run(hb[r:r + D]) for r in range(0, len(hb), D)]
        print(f"# {w} prompt of {len(prompt)} tokens done ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    rows = {k: {"a1": sum(v["a1"]) / len(v["a1"]), "own": sum(v["own"]) / len(v["own"]),
                f"acc@{D}": sum(v["acc"]) / len(v["acc"]), "n": len(v["a1"])}
            for k, v in hits.items()}
    print(f"\n| draft | resident layers | top-1 agreement (true prefix KV) | "
          f"own-KV agreement | accepted per depth-{D} block |")
    print("|---|---|---|---|---|")
    for k, r in rows.items():
        R = (int(k.split("@")[1]) if "@" in k else len(parse_layers(k.split()[1]))
             if k.startswith("set") else sum(map(int, k.split()[1].split("+"))))
        print(f"| {k} | {R} | {r['a1']:.3f} | {r['own']:.3f} | {r[f'acc@{D}']:.2f} |")
    print(f"\n{rows[names[0]]['n']} positions; {time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
