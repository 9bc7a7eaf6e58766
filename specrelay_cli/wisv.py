"""``specrelay wisv``: WISV's opt-in semantic acceptance. ``train`` labels greedy
draft/target mismatches on held-out text and fits the verifier's decision head;
``check-labels`` compares that label with executed tests; ``eval`` runs exact and
semantic acceptance side by side through the benchmark's signed server path and
executes the HumanEval completions (torch and the bench import only when a command
runs)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS

__all__ = ["wisv"]


@click.group()
def wisv():
    """WISV semantic acceptance (lossy, opt-in): train the decision head, evaluate it."""


class _Bar:
    """A tqdm bar on stderr fed by ``progress(done, total, text)`` callbacks; one bar
    per phase (a new total or a new phase name starts a new bar)."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar, self.phase = enabled, None, None

    def __call__(self, done: int, total: int, text: str) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        phase = text.split(":", 1)[0] if "greedy answers" in text else "labelling"
        if self.bar is None or phase != self.phase or total != self.bar.total:
            self.close()
            self.phase = phase
            self.bar = tqdm(total=total, desc=phase, file=sys.stderr, unit="seq",
                            dynamic_ncols=True)
        self.bar.n = done
        self.bar.set_postfix_str(text.rsplit(":", 1)[-1].strip()[:40], refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@wisv.command("train", context_settings={"show_default": True})
@click.option("--target", default="qwen2.5-coder-1.5b", help="Target model (preset or path).")
@click.option("--draft", default="qwen2.5-coder-0.5b", help="Draft model (torch; preset or path).")
@click.option("--dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16"]),
              help="dtype of both models.")
@click.option("--code", "n_code", default=64, type=click.IntRange(0, 100),
              help="HumanEval problems (seed-0 order, from index 100; --split eval: "
              "from 0, at most 100).")
@click.option("--chat", "n_chat", default=32, type=click.IntRange(0, 48),
              help="MT-Bench questions (seed-0 order, from index 48; --split eval: from "
              "0, at most 48).")
@click.option("--split", default="heldout", type=click.Choice(["heldout", "eval"]),
              help="heldout: prompts no evaluation reports (the shipped head's); eval: "
              "the evaluated prompts, for cross-fitting only (judge such a head with "
              "`wisv eval --split dev --head PATH`; `wisv eval` refuses it on its own "
              "problems).")
@click.option("--code-greedy-tokens", default=128, type=click.IntRange(0),
              help="Also label the target's own greedy completion of each HumanEval "
              "prompt, this many tokens (0: canonical solutions only).")
@click.option("--answer-tokens", default=64, type=click.IntRange(1),
              help="Tokens of the target's greedy MT-Bench answers.")
@click.option("-n", "--rollout", "n", default=12, type=click.IntRange(1, 256),
              help="Greedy rollout tokens after each branch of a mismatch.")
@click.option("--delta", default=1.5, type=click.FloatRange(0.0),
              help="Label margin in nats: acceptable iff S(draft) >= S(target) - delta.")
@click.option("--width", default=0, type=click.IntRange(0),
              help="Hidden width of the head (0: logistic regression).")
@click.option("--batch", default=12, type=click.IntRange(1),
              help="Mismatches per batched rollout (2 x this many rows a pass).")
@click.option("--threads", default=1, type=click.IntRange(1),
              help="torch threads (one is faster than two oversubscribed on a shared "
              "2-core machine).")
@click.option("--out", "-o", default=None, type=click.Path(dir_okay=False),
              help="Head file (.safetensors; the .json manifest goes beside it) "
              "[default: cloud_api/assets/wisv/<target>.safetensors].")
@click.option("--figures", default=None, type=click.Path(file_okay=False),
              help="Also write train.json (the manifest) and train.png (label balance, "
              "validation precision and accept rate by threshold) to this folder.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def train(target, draft, dtype, n_code, n_chat, split, code_greedy_tokens, answer_tokens,
          n, delta, width, batch, threads, out, figures, no_progress):
    """Label greedy mismatches of the real pair on held-out text and fit the head.

    \b
    Label: the target rolls out N tokens after the draft token d and after its own t;
    acceptable iff its log-likelihood of d + continuation is within DELTA nats of
    t + continuation. Labelled sequences are cached ($SPECRELAY_CACHE/wisv/).
    Example:
      specrelay wisv train --code 64 --chat 32 -n 12 --delta 1.5
    """
    if n_code + n_chat == 0:
        raise click.BadParameter("at least one of --code / --chat must be > 0",
                                 param_hint="--code/--chat")
    if split == "heldout" and (n_code > 64 or n_chat > 32):
        raise click.BadParameter("the held-out split has 64 HumanEval / 32 MT-Bench "
                                 "prompts", param_hint="--code/--chat")
    if split == "eval" and out is None:
        raise click.BadParameter("a head trained on the evaluated prompts must not "
                                 "replace the shipped one: pass --out", param_hint="--out")
    from cloud_api.wisv.train import train_head

    bar = _Bar(not no_progress)
    t0 = time.monotonic()
    try:
        man = train_head(target, draft, n_code, n_chat, n, delta, answer_tokens,
                         code_greedy_tokens, out, dtype, threads, widths=(width,),
                         batch=batch, progress=bar, split=split)
    finally:
        bar.close()
    m, v = man["metrics"], man["metrics"]["validation"]
    click.echo(f"{m['mismatches']} mismatches {m['mismatches_by_workload']}, acceptable "
               f"{m['acceptable']:.3f} {m['acceptable_by_workload']}")
    click.echo(f"chosen {m['chosen']}; validation ({v['n']} rows, "
               f"{m['validation_groups']} prompts): AUC {v['auc']} (log-prob gap alone "
               f"{v['auc_logp_gap']}), accuracy {v['accuracy']}")
    for thr, row in v["precision_at"].items():
        click.echo(f"  tau {thr}: precision {row['precision']}, accepts "
                   f"{row['accept_rate']} of mismatches (recall {row['recall']})")
    click.echo(f"wrote {man['path']} and its manifest ({time.monotonic() - t0:.0f} s)")
    if figures:
        d = Path(figures)
        d.mkdir(parents=True, exist_ok=True)
        (d / "train.json").write_text(json.dumps(man, indent=1) + "\n")
        _plot_train(man, d / "train.png")
        click.echo(f"wrote {d / 'train.json'} and {d / 'train.png'}")


def _plot_train(man: dict, path) -> None:
    """Two panels from a head's manifest: the histogram of S(d) - S(t) with the label's
    margin, and the validation precision / accept rate by threshold with the policy's
    thresholds marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = man["metrics"]
    delta = man["train"]["delta"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    h = m["gap_histogram"]
    e = h["edges"]
    a.bar(e[:-1], h["counts"], width=e[1] - e[0], align="edge",
          color=["#dd8452" if x >= -delta else "#4c72b0" for x in e[:-1]])
    a.axvline(-delta, color="k", ls="--", lw=1)
    a.set_xlabel("S(d) - S(t), nats (orange: acceptable)")
    a.set_ylabel("mismatches")
    a.set_title(f"{m['mismatches']} held-out mismatches, {100 * m['acceptable']:.0f} % "
                f"acceptable (delta {delta:g})", fontsize=9)
    cv = m["validation"]["curve"]
    t = [c["threshold"] for c in cv]
    b.plot(t, [c["precision"] if c["precision"] is not None else float("nan") for c in cv],
           "o-", label="precision")
    b.plot(t, [c["accept_rate"] for c in cv], "s-", label="accepted mismatches")
    for thr in m["validation"]["precision_at"]:
        b.axvline(float(thr), color="grey", ls=":", lw=1)
    b.set_xlabel("threshold tau (dotted: 0.66 cellular-edge, 0.73 weak, 0.9 strong)")
    b.set_ylim(0, 1.02)
    b.set_title(f"validation: AUC {m['validation']['auc']} ({m['validation']['n']} "
                f"mismatches of {m['validation_groups']} prompts)", fontsize=9)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@wisv.command("check-labels", context_settings={"show_default": True})
@click.option("--target", default="qwen2.5-coder-1.5b", help="Target model (preset or path).")
@click.option("--draft", default="qwen2.5-coder-0.5b", help="Draft model (torch; preset or path).")
@click.option("--problems", default=16, type=click.IntRange(1, 64),
              help="Held-out HumanEval problems to take mismatches from (training ones).")
@click.option("--max-mismatches", default=48, type=click.IntRange(1),
              help="Mismatches to complete and execute (both branches each).")
@click.option("-n", "--rollout", "n", default=12, type=click.IntRange(1, 256),
              help="The label's rollout tokens.")
@click.option("--delta", default=1.5, type=click.FloatRange(0.0), help="The label's margin (nats).")
@click.option("--max-tokens", default=160, type=click.IntRange(1),
              help="Tokens to complete the function from each branch.")
@click.option("--threads", default=1, type=click.IntRange(1), help="torch threads.")
@click.option("--head", default="auto", metavar="auto|PATH|off",
              help="Decision head whose P(accept) is scored against the executed outcome "
              "(auto: the target preset's shipped head).")
@click.option("--text", default="canonical", type=click.Choice(["canonical", "greedy"]),
              help="Sequences to take mismatches from: prompt + canonical solution, or "
              "prompt + the target's greedy completion (the prefixes seen when serving).")
@click.option("--out", "-o", default="wisv-label-check.json", type=click.Path(dir_okay=False),
              help="JSON report (+ .features.safetensors: the head's inputs with both "
              "outcomes).")
def check_labels(target, draft, problems, max_mismatches, n, delta, max_tokens, threads,
                 head, text, out):
    """Compare the likelihood label with executed tests on held-out code mismatches.

    
    At each mismatch the target completes the function from the draft token and from
    its own; both are executed with the problem's tests.
    """
    from bench.wisv_labels import check_labels as run, write_check

    rep = run(target, draft, problems, max_mismatches, n, delta, max_tokens,
              threads=threads, head=None if head == "off" else head, text=text,
              log=lambda s: click.echo(s, err=True))
    for lbl in ("acceptable", "unacceptable"):
        k = rep[lbl]
        click.echo(f"{lbl:12s}: {k['mismatches']} mismatches, target branch passes "
                   f"{k['t_passes']}, draft branch passes too in "
                   f"{k['d_passes_when_t_passes']}, same outcome {k['same_outcome']}")
    h = rep["harm"]
    click.echo(f"harm (target branch passes, draft branch fails): {h['harmed']} of "
               f"{h['t_passes']}; AUC safe vs harmful: gap {h['auc_gap']}, head "
               f"{h.get('auc_head')}")
    click.echo(f"wrote {write_check(rep, out)} ({rep['wall_s']:.0f} s)")


@wisv.command("fit-executed", context_settings={"show_default": True})
@click.argument("reports", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--target", default="qwen2.5-coder-1.5b",
              help="Target preset: its shipped head is the reference.")
@click.option("--reference", default="auto", metavar="auto|PATH|off",
              help="Head compared with (auto: the target preset's shipped head).")
@click.option("--folds", default=8, type=click.IntRange(2), help="Grouped folds (by problem).")
@click.option("--out", "-o", default=None, type=click.Path(dir_okay=False),
              help="Also fit the best setting on every row and write it here (.safetensors "
              "+ .json manifest).")
@click.option("--json", "json_out", default=None, type=click.Path(dir_okay=False),
              help="Write the comparison as JSON.")
def fit_executed(reports, target, reference, folds, out, json_out):
    """Fit the decision head on executed-test labels and judge it out of fold.

    \b
    REPORTS: `wisv check-labels` JSON reports (their .features.safetensors beside).
    Label: acceptable unless the target's branch passes and the draft's fails. Each
    problem's mismatches are scored by a head fitted without that problem; heads are
    compared at equal accept rates by draft-only minus target-only passes.
    Example:
      specrelay wisv fit-executed docs/figures/wisv/label_check_harm.json \\
          docs/figures/wisv/label_check_greedy.json
    """
    from cloud_api.wisv.executed import fit_executed as run
    from cloud_api.wisv.head import load_head
    from cloud_api.wisv.serving import shipped_head_path

    ref = None
    if reference != "off":
        path = shipped_head_path(target) if reference == "auto" else reference
        if path is not None:
            try:
                ref = load_head(path)[0]
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint="--reference") from None
    try:
        rep = run(reports, ref, out, target, folds)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="REPORTS") from None

    def line(name: str, r: dict) -> None:
        cells = ", ".join(f"{t['fraction']:.0%}: {t['harms']}/{t['gains']} "
                          f"({t['net']:+.3f})" for t in r["table"])
        click.echo(f"  {name:34s} harm AUC {r['harm_auc']:.3f}  {cells}")

    click.echo(f"{rep['rows']} executed mismatches of {rep['problems']} problems, "
               f"acceptable {rep['acceptable']:.3f}; per accept fraction: harms/gains "
               "(net passes per accepted mismatch)")
    if "reference" in rep:
        line("reference head (its own label)", rep["reference"])
    for g in rep["grid"]:
        line(f"executed, l2 {g['l2']:g}, hidden scale {g['hidden_scale']:g}", g)
    click.echo(f"best out of fold: {rep['best']}")
    if json_out:
        Path(json_out).write_text(json.dumps(rep, indent=1) + "\n")
        click.echo(f"wrote {json_out}")
    if "path" in rep:
        click.echo(f"wrote {rep['path']} and its manifest")


@wisv.command("pool")
@click.argument("folders", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.option("--json", "json_out", default=None, type=click.Path(dir_okay=False),
              help="Also write the JSON object to this file.")
def pool(folders, json_out):
    """Pool HumanEval pass@1 of finished `wisv eval` folders on disjoint problems.

    \b
    Per folder: its head and how many of its problems that head was trained on (0: held
    out). Per profile: pass@1 exact and semantic over all their problems, the paired
    difference with its bootstrap 95 % interval and the exact McNemar p; then one JSON
    object {"profiles", "folders"}. Example (the eval split's 100 problems judged by the
    shipped head, the dev split's 64 by a head cross-fitted on the eval split):
      specrelay wisv pool docs/figures/wisv/d16-100 docs/figures/wisv/xfit-dev-64 --json docs/figures/wisv/pool_heldout_164.json
    """
    from bench.wisv_eval import folder_heads, pooled_stats

    try:
        res = pooled_stats(folders)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="FOLDERS") from None
    heads = folder_heads(folders)
    for h in heads:
        trained = ("the head's training problems unknown" if h["in_head_training"] is None
                   else f"{h['in_head_training']} of them in the head's training set")
        click.echo(f"{h['folder']}: head {h['head']}, {h['problems']} HumanEval problems, "
                   f"{trained}")
    for prof, st in res.items():
        lo, hi = st["pass1_diff_ci95"]
        click.echo(f"{prof:14s} pass@1 exact {st['pass1_exact']:.3f} semantic "
                   f"{st['pass1_semantic']:.3f} (diff {100 * st['pass1_diff']:+.1f} pt, "
                   f"95 % CI [{100 * lo:+.1f}, {100 * hi:+.1f}], McNemar p "
                   f"{st['mcnemar_p']:.3f}; {st['only_exact_passed']} only exact, "
                   f"{st['only_semantic_passed']} only semantic; {st['problems']} problems)")
    rep = {"profiles": res, "folders": heads}
    click.echo(json.dumps(rep))
    if json_out:
        Path(json_out).write_text(json.dumps(rep, indent=1) + "\n")


@wisv.command("eval", context_settings={"show_default": True})
@click.option("--quick", is_flag=True, help="<= 15 minutes on 2 cores: 40 HumanEval "
              "problems (max 192 new tokens each) on cellular-edge, 4 MT-Bench "
              "questions x 48 tokens.")
@click.option("--target", default="qwen2.5-coder-1.5b", help="Target model (preset).")
@click.option("--draft", default=None, help="Draft model [default: the bench's default "
              "draft for the target].")
@click.option("--profiles", default=None, help="Comma list of network profiles "
              "[default: weak,cellular-edge; --quick: cellular-edge].")
@click.option("--humaneval", "n_code", default=None, type=click.IntRange(0, 100),
              help="HumanEval problems, the first of the split in the seed-0 order "
              "[default: 100 (dev: 64); --quick: 40].")
@click.option("--mtbench", "n_chat", default=None, type=click.IntRange(0, 48),
              help="MT-Bench questions [default: 16; --quick: 4].")
@click.option("--max-new-tokens", default=None, type=click.IntRange(1),
              help="HumanEval token budget per problem [default: 384; --quick: 192].")
@click.option("--chat-tokens", default=None, type=click.IntRange(1),
              help="MT-Bench tokens per question [default: 128; --quick: 48].")
@click.option("--depth", default=None, type=click.IntRange(1, MAX_DRAFT_TOKENS),
              help="Draft depth (tokens per block) of both modes: semantic acceptance "
              "lets a block run past the draft's first wrong token, so deep blocks "
              "show its gain on a bad link (100 problems at 16: 1.38x / 1.43x the "
              "exact accepted length on weak / cellular-edge) [default: 16].")
@click.option("--head", default="auto", metavar="auto|PATH",
              help="Decision head the server loads (as `serve --wisv-head`).")
@click.option("--max-per-block", default=None, type=click.IntRange(1, MAX_DRAFT_TOKENS),
              help="Most draft tokens of one block accepted semantically (as `serve "
              "--wisv-max-per-block`) [default: the server's, 4].")
@click.option("--strict", default=None, type=click.FloatRange(0, 1, min_open=True),
              help="Head-probability threshold on a good link (as `serve --wisv-strict`) "
              "[default: 0.9].")
@click.option("--relaxed", default=None, type=click.FloatRange(0, 1, min_open=True),
              help="Threshold on a bad link (as `serve --wisv-relaxed`) [default: 0.35].")
@click.option("--guard", default=None, type=click.Choice(["operators", "off"]),
              help="The server's token guard (as `serve --wisv-guard`) [default: the "
              "server's, off].")
@click.option("--split", default="eval", type=click.Choice(["eval", "dev"]),
              help="eval: the first problems of the seed-0 order (never seen by the "
              "shipped head); dev: the 64 HumanEval / 32 MT-Bench prompts after them, "
              "the shipped head's training prompts (in-sample for it; held out for a "
              "head cross-fitted with `wisv train --split eval`).")
@click.option("--out", "-o", default="wisv-eval", type=click.Path(file_okay=False),
              help="Folder for wisv_eval.json, wisv_eval.png and requests.jsonl.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def eval_(quick, target, draft, profiles, n_code, n_chat, max_new_tokens, chat_tokens,
          depth, head, max_per_block, strict, relaxed, guard, split, out, no_progress):
    """Exact vs semantic acceptance on the same prompts and seeds, HumanEval executed.

    \b
    Prints a summary, then ONE JSON object last (pass1_exact, pass1_semantic,
    accepted_length_*, rounds_*, problems, ...).
    Example:
      specrelay wisv eval --quick --out docs/figures/wisv/quick
    """
    from bench.wisv_eval import EvalConfig, print_report, run_eval

    cfg = EvalConfig.preset(quick, target=target, draft=draft, profiles=profiles,
                            n_code=n_code, n_chat=n_chat, max_new_tokens=max_new_tokens,
                            chat_tokens=chat_tokens, depth=depth, head=head,
                            max_per_block=max_per_block, strict=strict, relaxed=relaxed,
                            guard=guard, split=split)
    from bench.wisv_eval import check_head_split
    from cloud_api.wisv.threshold import ThresholdPolicy

    try:
        check_head_split(head, split)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--head") from None
    try:                                 # the server would refuse it after loading
        ThresholdPolicy(**{k: v for k, v in (("strict", strict), ("relaxed", relaxed))
                           if v is not None})
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--strict/--relaxed") from None
    report = run_eval(cfg, out, progress=not no_progress,
                      log=lambda s: click.echo(s, err=True))
    print_report(report, click.echo)
    click.echo(json.dumps(report["summary"]))

