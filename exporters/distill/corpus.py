"""Stage 3's text: token windows from text files on this machine (Python sources and
.rst/.md/.txt docs), for one teacher-forced target prefill each (~10x cheaper per
token than generating)."""

from __future__ import annotations

import os
import random
import sysconfig
from pathlib import Path
from typing import Sequence


def _corpus_files(dirs: Sequence[str | Path]) -> tuple[list[Path], list[Path]]:
    """(code files, prose files) under ``dirs``, sorted; tests/licences/tiny files skipped."""
    code, prose = [], []
    skip = ("license", "licence", "copying", "record", "metadata", "authors", "changelog",
            "notice", "top_level", "entry_points", "requires", "sources")
    for d in dirs:
        for root, subdirs, files in os.walk(d):
            subdirs[:] = sorted(s for s in subdirs if s not in ("__pycache__", "tests", "test")
                                and not s.endswith(".dist-info") and not s.startswith("."))
            for f in sorted(files):
                p = Path(root) / f
                low = f.lower()
                if any(low.startswith(s) for s in skip):
                    continue
                try:
                    size = p.stat().st_size
                except OSError:
                    continue
                if size < 2048 or size > 2_000_000:
                    continue
                if low.endswith(".py"):
                    code.append(p)
                elif low.endswith((".rst", ".md", ".txt")):
                    prose.append(p)
    return code, prose


def default_corpus_dirs() -> list[str]:
    """Python's standard library and site-packages on this machine."""
    dirs = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    return [d for i, d in enumerate(dirs) if d and Path(d).is_dir() and d not in dirs[:i]]


def corpus_chunks(tok, dirs: Sequence[str | Path], total_tokens: int, chunk: int,
                  seed: int, prose_frac: float = 0.5) -> list[tuple[str, list[int]]]:
    """Token windows of ``chunk`` tokens from text files, ``total_tokens`` in all.

    Returns [(kind, ids)] with kind ``corpus-code`` or ``corpus-prose``; deterministic for
    (files on disk, seed). One window per file, files drawn without replacement.
    """
    code, prose = _corpus_files(dirs)
    rng = random.Random(seed)
    rng.shuffle(code)
    rng.shuffle(prose)
    n = max(0, total_tokens // chunk)
    want = {"corpus-prose": round(n * prose_frac) if prose else 0}
    want["corpus-code"] = n - want["corpus-prose"] if code else 0
    if not code:
        want["corpus-prose"] = n if prose else 0
    out = []
    for kind, files in (("corpus-code", code), ("corpus-prose", prose)):
        got = 0
        for p in files:
            if got >= want[kind]:
                break
            try:
                text = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if sum(c.isascii() for c in text[:4000]) < 0.95 * min(len(text), 4000):
                continue
            ids = tok.encode(text, add_special_tokens=False)
            if len(ids) < chunk:
                continue
            start = rng.randrange(0, len(ids) - chunk + 1)
            out.append((kind, list(ids[start:start + chunk])))
            got += 1
    return out

