"""Stage 1 of the distiller: the prompts (MT-Bench, HumanEval, user files) and their
held-out split **by prompt** (a prompt's continuations are all train or all held out)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from specrelay_data.workloads import humaneval_problems, mtbench_questions


@dataclass
class PromptItem:
    """One prompt: ``id`` (unique), ``source`` (mtbench/humaneval/user), ``kind``
    (chat|completion), ``text``, optional ``turn2`` (MT-Bench second user turn)."""

    id: str
    source: str
    kind: str
    text: str
    turn2: str | None = None



def builtin_prompts() -> list[PromptItem]:
    """MT-Bench questions (chat, with their second turn) and HumanEval problems
    (completion), read by :mod:`specrelay_data.workloads` from the installed packages' data files
    (never imported). A package that is missing, or lacks its data file, adds nothing."""
    out: list[PromptItem] = []
    try:
        for q in mtbench_questions():
            t = q["turns"]
            out.append(PromptItem(f"mtbench/{q['question_id']}", "mtbench", "chat", t[0],
                                  t[1] if len(t) > 1 else None))
    except RuntimeError:
        pass
    try:
        for t in humaneval_problems():
            out.append(PromptItem(t["task_id"], "humaneval", "completion", t["prompt"]))
    except RuntimeError:
        pass
    return out


def read_prompts_file(path: str | Path) -> list[PromptItem]:
    """User prompts. ``.jsonl``: one object per line with ``text`` (or ``prompt``, or
    ``turns`` [list]) and optional ``kind`` (``chat`` default | ``completion``) and ``id``.
    Any other file: one chat prompt per non-empty line."""
    path = Path(path)
    items = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            o = json.loads(line)
            turns = o.get("turns")
            text = o.get("text") or o.get("prompt") or (turns[0] if turns else None)
            if not isinstance(text, str):
                raise ValueError(f"{path}:{n + 1}: needs 'text', 'prompt' or 'turns'")
            kind = o.get("kind", "chat")
            if kind not in ("chat", "completion"):
                raise ValueError(f"{path}:{n + 1}: kind must be chat or completion")
            items.append(PromptItem(f"{path.name}/{o.get('id', n)}", "user", kind, text,
                                    turns[1] if turns and len(turns) > 1 else None))
        else:
            items.append(PromptItem(f"{path.name}/{n}", "user", "chat", line.strip()))
    return items


def split_prompts(items: list[PromptItem], frac: float, min_n: int, seed: int):
    """Held-out split **by prompt**, per source: shuffled with ``seed``; the first
    ``max(min_n, round(frac*n))`` (never all of them) are held out. -> (train, heldout)."""
    by: dict[str, list[PromptItem]] = {}
    for it in items:
        by.setdefault(it.source, []).append(it)
    train, held = [], []
    for src in sorted(by):
        group = sorted(by[src], key=lambda p: p.id)
        random.Random(f"{seed}:{src}").shuffle(group)
        k = min(len(group) - 1, max(min_n, round(frac * len(group)))) if frac > 0 else 0
        k = max(k, 0)
        held += group[:k]
        train += group[k:]
    return train, held


def domain_of(item_source: str, kind: str) -> str:
    """Evaluation domain: ``code`` (completion prompts, HumanEval) or ``chat``."""
    return "code" if kind == "completion" else "chat"

