"""A draft LM head over the frequent part of the vocabulary (FR-Spec: Zhao et al. 2025,
*Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative
Sampling*, §3: the draft's LM head restricted to the most frequent tokens, the target's
verification unchanged).

A draft's decode step is memory-bound, and Qwen2.5's 151,936-row LM head is the largest
single matrix the 0.5B draft reads per token. Keeping only K rows makes the step cheaper;
the price is that the draft cannot propose a token outside them, so where the target
emits one the draft misses there. The output stays the target's: the verifier decides
every token, and the draft's q (the distribution it samples from) gives the dropped
tokens probability 0, which the acceptance rule allows (Leviathan et al. 2023, §2.3,
needs only that a draft token be drawn from the q it reports).

Which K rows: a frequency ranking of the tokenizer's vocabulary, built once per
tokenizer (``python -m exporters.onnx.head_vocab build``) and shipped as an asset
(``exporters/assets/head_vocab/<tokenizer fingerprint>.npy``, the ranked ids, and a
``.json`` beside it saying how it was built). The ranking: the first
:data:`MERGE_PREFIX` ids in id order (byte-level BPE assigns ids in merge order, so low
ids are the merges the tokenizer's own training corpus made first: a corpus-free
frequency prior), then the rest by their mean share in three corpora that every machine
with this project has at hand: the Python standard library's sources (code), the
Markdown / reStructuredText files of the installed packages and system docs (prose with
Markdown), and English word frequencies (``wordfreq``: words with and without a leading
space and capitalised) weighted by frequency. Added tokens (``<|im_end|>`` and the like)
are always kept. The export keeps the first K of the ranking (:func:`head_ids`).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

#: Ids kept in id order before the corpus ranking (byte-level BPE merge order).
MERGE_PREFIX = 16384
ASSETS = Path(__file__).resolve().parent.parent / "assets" / "head_vocab"


def _files(patterns: Iterable[str]) -> list[str]:
    out = set()
    for p in patterns:
        out.update(glob.glob(p, recursive=True))
    return sorted(out)


def corpus_files() -> dict[str, list[str]]:
    """The ranking's text corpora on this machine: ``code`` (the standard library's
    ``.py`` files, tests excluded) and ``docs`` (``.md`` / ``.rst`` files of the
    installed packages and of ``/usr/share/doc``)."""
    std, site = sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]
    code = [f for f in _files([f"{std}/**/*.py"])
            if "/site-packages/" not in f and "/test/" not in f and "/tests/" not in f]
    docs = _files([f"{site}/**/*.md", f"{site}/**/*.rst", "/usr/share/doc/**/*.md",
                   f"{sys.prefix}/share/**/*.md"])
    return {"code": code, "docs": docs}


def count_tokens(tokenizer, paths: Sequence[str], vocab: int,
                 batch: int = 64) -> np.ndarray:
    """Token counts float64 [vocab] over the text files ``paths`` (unreadable or
    non-UTF-8 files skipped)."""
    counts = np.zeros(vocab)
    texts: list[str] = []

    def flush():
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            counts[:] += np.bincount(ids, minlength=vocab)[:vocab]
        texts.clear()

    for p in paths:
        try:
            texts.append(Path(p).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        if len(texts) == batch:
            flush()
    flush()
    return counts


def word_counts(tokenizer, vocab: int, words: int = 320_000) -> np.ndarray:
    """Token shares float64 [vocab] of English words (``wordfreq``'s ``top_n_list``,
    each weighted by its frequency): ``" word"`` 0.8, ``"word"`` 0.05, ``" Word"`` 0.1,
    ``"Word"`` 0.05. Raises ModuleNotFoundError without ``wordfreq`` (the ``[export]``
    extra)."""
    import wordfreq

    forms = []
    for w in wordfreq.top_n_list("en", words):
        f = wordfreq.word_frequency(w, "en")
        cap = w[:1].upper() + w[1:]
        forms += [(" " + w, 0.8 * f), (w, 0.05 * f), (" " + cap, 0.1 * f), (cap, 0.05 * f)]
    counts = np.zeros(vocab)
    enc = tokenizer([t for t, _ in forms], add_special_tokens=False)["input_ids"]
    for ids, (_, f) in zip(enc, forms):
        for i in ids:
            if i < vocab:
                counts[i] += f
    return counts


def rank_vocab(shares: Sequence[np.ndarray], vocab: int,
               merge_prefix: int = MERGE_PREFIX) -> np.ndarray:
    """The ranking int64 [vocab]: ids ``0..merge_prefix-1`` in order, then the others by
    the mean of the normalised ``shares`` (each float [vocab]) descending, ties to the
    lower id."""
    score = sum(s / s.sum() for s in shares if s.sum() > 0)
    rest = np.lexsort((np.arange(vocab), -np.asarray(score, dtype=np.float64)))
    head = np.arange(min(merge_prefix, vocab))
    return np.concatenate([head, rest[rest >= len(head)]]).astype(np.int64)


def asset_path(fingerprint: str) -> Path:
    """Where the ranking of the tokenizer with this fingerprint is shipped."""
    return ASSETS / f"{fingerprint}.npy"


def head_ids(tokenizer, size: int, vocab: int) -> np.ndarray | None:
    """The ids int64 [<= size + added tokens] a head of ``size`` rows keeps for
    ``tokenizer`` (sorted): the first ``size`` of its shipped ranking plus every added
    token below ``vocab`` (the model's vocabulary: Qwen2.5 pads its 151,665 tokens to
    151,936 rows); None when no ranking ships for this tokenizer (the export then keeps
    the whole head) or ``size`` covers the vocabulary. Raises ValueError for a ranking
    that does not fit ``vocab``."""
    from edge_sdk.models import tokenizer_fingerprint

    path = asset_path(tokenizer_fingerprint(tokenizer))
    if size >= vocab or not path.is_file():
        return None
    order = np.load(path).astype(np.int64)
    if len(order) > vocab or (len(order) and order.max() >= vocab):
        raise ValueError(f"{path}: a ranking of {len(order)} ids does not fit a "
                         f"vocabulary of {vocab}")
    keep = np.zeros(vocab, dtype=bool)
    keep[order[:size]] = True
    added = [i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i < vocab]
    keep[added] = True
    return np.nonzero(keep)[0].astype(np.int64)


def record(folder: Path, manifest: dict, ids: np.ndarray) -> None:
    """Write ``ids`` beside the graph in ``folder`` and name them in ``manifest``
    (``head_ids``, read by :class:`~edge_sdk.drafters.onnx.OnnxRunner`; ``head_vocab``:
    the rows kept)."""
    from edge_sdk.drafters.onnx import HEAD_IDS_FILE

    np.save(Path(folder) / HEAD_IDS_FILE, np.asarray(ids, dtype=np.int64))
    manifest["head_ids"] = HEAD_IDS_FILE
    manifest["head_vocab"] = {"rows": int(len(ids))}


def build(target: str, out_dir: Path = ASSETS) -> dict:
    """Rank ``target``'s tokenizer (:func:`rank_vocab` over :func:`corpus_files` and
    :func:`word_counts`) and write ``<fingerprint>.npy`` + ``.json`` into ``out_dir``.
    Returns the ``.json`` record."""
    from edge_sdk.models import load_tokenizer, tokenizer_fingerprint

    tok = load_tokenizer(target)
    vocab = max(len(tok), max(tok.added_tokens_decoder, default=0) + 1)
    files = corpus_files()
    shares = {k: count_tokens(tok, v, vocab) for k, v in files.items()}
    shares["words"] = word_counts(tok, vocab)
    order = rank_vocab(list(shares.values()), vocab)
    fp = tokenizer_fingerprint(tok)
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / f"{fp}.npy", order.astype(np.int32))
    rec = {"tokenizer": target, "fingerprint": fp, "vocab": vocab,
           "merge_prefix": MERGE_PREFIX,
           "corpora": {k: {"files": len(v), "tokens": int(shares[k].sum())}
                       for k, v in files.items()},
           "words": {"source": "wordfreq top_n_list('en', 320000)",
                     "tokens_seen": int((shares["words"] > 0).sum())},
           "command": f"python -m exporters.onnx.head_vocab build --target {target}"}
    (out_dir / f"{fp}.json").write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="rank a tokenizer's vocabulary into the assets")
    b.add_argument("--target", default="qwen2.5-coder-1.5b")
    b.add_argument("--out", type=Path, default=ASSETS)
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(build(a.target, a.out)))


if __name__ == "__main__":
    main()
