"""``specrelay fsd``: FSD early exits. ``calibrate`` measures, per exit layer, head kind
and provisional rule, how often the early verdict equals the final one on real draft
blocks, picks the exit layer and caches its tuned head (torch imports only when run)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

__all__ = ["fsd"]


def _int_list(ctx, param, value):
    try:
        out = [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter("comma-separated layer numbers, e.g. 20,22,24") from None
    if not out:
        raise click.BadParameter("at least one layer")
    return out


@click.group()
def fsd():
    """FSD early exits (provisional verdicts from an intermediate target layer)."""


@fsd.command("calibrate", context_settings={"show_default": True})
@click.option("--target", default="qwen2.5-coder-1.5b", help="Target model (preset or path).")
@click.option("--draft", default="qwen2.5-coder-0.5b", help="Draft model (torch; preset or path).")
@click.option("--dtype", default="bfloat16", help="dtype of both models.")
@click.option("--layers", default="18,20,22,24,26", callback=_int_list,
              help="Exit layers to measure (1-based: the output of decoder layer N).")
@click.option("--prompts", default=4, type=int,
              help="Evaluation prompts per workload (humaneval, mtbench; seed-0 order).")
@click.option("--depth", default=6, type=int, help="Draft block size.")
@click.option("--max-new-tokens", default=32, type=int, help="Tokens generated per prompt.")
@click.option("--vocab", default=32768, type=int,
              help="Restricted exit vocabulary: the first N ids (0 = the full vocabulary).")
@click.option("--max-cost", default=5.0, type=float,
              help="Largest exit cost allowed, in % of the verify pass.")
@click.option("--refit", is_flag=True, help="Fit the tuned heads even when cached.")
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False),
              help="Folder for calibration.json and calibration.png.")
def calibrate(target, draft, dtype, layers, prompts, depth, max_new_tokens, vocab,
              max_cost, refit, out):
    """Measure early-verdict hit rates on real prompts and choose the exit layer.

    \b
    Example:
      specrelay fsd calibrate --layers 18,20,22,24,26 --prompts 4 --out calib
    """
    t0 = time.monotonic()
    from cloud_api.exit_calibrate import calibrate as run, plot
    from cloud_api.exit_fit import EARLY_EXIT_DEFAULTS
    from edge_sdk.models import load_model

    tm, tok = load_model(target, dtype=dtype)
    dm, _ = load_model(draft, dtype=dtype)
    vocab = vocab or None
    t_fit = time.monotonic()
    heads, fit_info = _heads(tm, tok, layers, vocab, refit)
    t_fit = time.monotonic() - t_fit
    report = run(tm, dm, _prompts(tok, prompts), heads, depth=depth,
                 max_new_tokens=max_new_tokens, max_cost=max_cost / 100,
                 eos=_eos(tm, tok))
    report.update(target=target, draft=draft, dtype=dtype, vocab=vocab, fit=fit_info,
                  prompts_per_workload=prompts, fit_s=round(t_fit, 1),
                  wall_s=round(time.monotonic() - t0, 1))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out / "calibration.png")
    _print(report)
    click.echo(f"wrote {out / 'calibration.json'} and {out / 'calibration.png'} "
               f"({report['wall_s']:.0f} s)")
    _advise(report, tm, vocab, EARLY_EXIT_DEFAULTS.get(target))


def _heads(tm, tok, layers, vocab, refit):
    """kind -> layer -> ExitHead (tuned heads loaded from the cache, the missing ones
    fitted and cached in one pass) and the fit figures per layer."""
    from cloud_api.early_exit import untrained_head
    from cloud_api.exit_fit import fit_exit_heads, head_path, load_exit_head

    tuned = {} if refit else {l: load_exit_head(tm, l, vocab) for l in layers}
    missing = [l for l in layers if tuned.get(l) is None]
    info = {}
    if missing:
        click.echo(f"fitting tuned exit heads at layers {missing} (about a minute) ...")
        fitted, info = fit_exit_heads(tm, tok, missing, vocab)
        tuned.update(fitted)
    for l in layers:
        if l not in info:
            mpath = head_path(tm, l, vocab).with_name("manifest.json")
            info[l] = json.loads(mpath.read_text()).get(head_path(tm, l, vocab).name, {})
    return ({"untrained": {l: untrained_head(tm, l, vocab) for l in layers},
             "tuned": tuned}, {str(l): info[l] for l in layers})


def _prompts(tok, n):
    from specrelay_data.workloads import load_workload
    from edge_sdk.models import encode_prompt

    return [(w, encode_prompt(tok, p.text, p.kind == "chat"))
            for w in ("humaneval", "mtbench") for p in load_workload(w, n)]


def _eos(tm, tok):
    from edge_sdk.models import eos_ids

    return eos_ids(tm, tok)


def _print(report):
    cov = report["coverage"]
    click.echo(f"{report['rounds']} rounds ({report['rounds_by_workload']}), mean accepted "
               f"{report['mean_accepted']}, verify pass {report['pass_ms']} ms, draft block "
               f"{report['draft_ms']} ms (medians); heads {report['fit_s']} s, rounds "
               f"{report['loop_s']} s")
    click.echo(f"final next tokens inside the exit vocabulary: {cov['next_tokens']} "
               f"(all rows {cov['all_rows']}; by size {cov['next_by_k']})")
    click.echo(f"{'layer':>5} {'kind':>9} {'rule':>4} {'hit':>6} {'a=a':>6} {'top1':>6} "
               f"{'cost%':>6} {'score':>6}  by workload")
    for r in report["results"]:
        click.echo(f"{r['layer']:>5} {r['kind']:>9} {r['rule']:>4} {r['hit_rate']:>6.3f} "
                   f"{r['accept_agree']:>6.3f} {r['top1']:>6.3f} {_pct(r['cost_pct']):>6} "
                   f"{r['score']:>6.3f}  {r['hit_by_workload']}")


def _pct(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _advise(report, tm, vocab, default):
    from cloud_api.exit_fit import head_path

    c = report["chosen"]
    if c is None:
        click.echo(f"no exit costs at most {report['max_cost_pct']} % of the pass: "
                   "leave early exits off")
        return
    click.echo(f"chosen: layer {c['layer']}, {c['kind']} head, top-{c['rule']} rule "
               f"(hit rate {c['hit_rate']:.3f}, cost {c['cost_pct']:.2f} % of the pass)")
    if c["kind"] == "tuned":
        click.echo(f"tuned head cached at {head_path(tm, c['layer'], vocab)}")
    if default and default.get("layer") != c["layer"]:
        click.echo(f"(the built-in default for this target is layer {default['layer']})")
    click.echo("add to `specrelay serve`:")
    click.echo(f"  --early-exit {c['layer']}")
