"""Pass costs of the budgeted local target, dense against packed (CATS, the
constants of :mod:`edge_sdk.local_target.budget`: ``MEM_BW``, ``MEM_BW_PACKED``).

    python -m bench.probes.local_pass_cost [--packed 1] [--R 12 --R2 10] [--storage nvme]

One process per setting (its RSS is its own): builds the
:class:`~edge_sdk.local_target.runner.OffloadedTarget` of split ``R1 + R2`` (packed or
dense), prefills a 200-token context, then times (medians, one thread): one decoder
layer for 1 and 8 tokens, the full head, the skip draft's token
(:class:`~edge_sdk.local_target.skip.SkipDraft`, 32768-id vocabulary), and full passes
of 1, 4, 8 tokens on the emulated storage. Prints the RSS the build added, the peak,
and :meth:`~edge_sdk.local_target.runner.OffloadedTarget.resident_bytes`; ``--save``
writes the full passes' logits (float32 [q, V] each) for a bit-equality check between
a packed and a dense run.
"""

from __future__ import annotations

import argparse
import resource
import time


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _median_ms(f, n: int = 7) -> float:
    f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1e3


def main(argv=None) -> dict:
    from types import SimpleNamespace

    import torch
    from transformers import AutoConfig, GenerationConfig

    from edge_sdk.exit_head import restricted_vocab
    from edge_sdk.local_target.load import DRAFT_VOCAB, checkpoint_dir
    from edge_sdk.local_target.runner import OffloadedTarget
    from edge_sdk.local_target.skip import SkipDraft
    from edge_sdk.local_target.storage import Storage

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--packed", type=int, default=1)
    ap.add_argument("--R", type=int, default=12)
    ap.add_argument("--R2", type=int, default=10)
    ap.add_argument("--storage", default="nvme")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    folder = checkpoint_dir(a.target, "bfloat16")
    cfg = AutoConfig.from_pretrained(folder, local_files_only=True)
    gen = GenerationConfig.from_pretrained(folder, local_files_only=True)
    ids = restricted_vocab(SimpleNamespace(config=cfg, generation_config=gen), DRAFT_VOCAB)
    r0 = _rss()
    st = Storage(folder / "model.safetensors", a.storage)
    t = OffloadedTarget(st, cfg, a.R, torch.bfloat16, False, a.R2, packed=bool(a.packed),
                        draft_ids=ids)
    t.model.generation_config = gen
    out = {"packed": t.packed, "rss_build_gb": (_rss() - r0) / 1e9,
           "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
           "resident_bytes_gb": t.resident_bytes() / 1e9}
    prompt = list(range(1000, 1200))
    t.reset()
    t.run_layers(t.embed(prompt[:-1]), 0, t.num_layers)
    P = len(prompt) - 1
    for q in (1, 8):
        x = torch.randn(1, q, int(cfg.hidden_size)).bfloat16()

        def one():
            t.crop(P, range(0, 1))
            t.run_layers(x, 0, 1)
        out[f"layer_q{q}_ms"] = _median_ms(one)
        out[f"head_q{q}_ms"] = _median_ms(lambda: t.model.lm_head(x))
    t.crop(P)
    d = SkipDraft(t, DRAFT_VOCAB)

    def draft():
        d.step(prompt[-1])
        t.crop(P)
    out["draft_token_ms"] = _median_ms(draft)
    logits = []
    for q in (1, 4, 8):
        t.crop(P)
        t0 = time.perf_counter()
        logits.append(t.forward(prompt[-1:] + [5] * (q - 1)))
        out[f"full_q{q}_s"] = time.perf_counter() - t0
    if a.save:
        torch.save(logits, a.save)
    out["peak_end_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    for k, v in out.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    return out


if __name__ == "__main__":
    main()
