"""``specrelay draft distill``: the distiller's click command (mounted by the top-level
CLI; ``python -m exporters.distill`` runs it on its own)."""

from __future__ import annotations

import json

import click

from exporters.distill.config import DistillConfig
from exporters.distill.pipeline import run_distill


def _int_list(ctx, param, value):
    try:
        return [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter("comma-separated layer indices, e.g. 0,1,2,3") from None


@click.command("distill", context_settings={"show_default": True})
@click.option("--target", default="smollm2-135m",
              help="Target model: preset, HF path/id or GGUF (edge_sdk.models.load_model).")
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False),
              help="Output draft folder.")
@click.option("--work-dir", default="distill-work", type=click.Path(file_okay=False),
              help="Cache of data shards and checkpoints; rerun to resume.")
@click.option("--layers", default="0,1,2,3,4,5", callback=_int_list,
              help="Target layers the draft's layers start from (e.g. 0,1,2,3,28,29).")
@click.option("--head-vocab", default=12288, type=int,
              help="Keep only the N most frequent ids in the draft head (0 = full vocab).")
@click.option("--seed", default=0, type=int)
@click.option("--threads", default=1, type=int, help="torch threads.")
@click.option("--data-dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
              help="Target dtype for making training data.")
@click.option("--train-dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
              help="Autocast dtype for training (master weights stay float32).")
@click.option("--builtin-prompts/--no-builtin-prompts", default=True,
              help="Use MT-Bench and HumanEval prompts.")
@click.option("--prompts-file", "prompts_files", multiple=True, type=click.Path(dir_okay=False, exists=True),
              help="More prompts: .jsonl ({text|prompt|turns, kind}) or one per line.")
@click.option("--heldout-frac", default=0.1, type=float, help="Held-out share per source.")
@click.option("--heldout-min", default=12, type=int, help="Held-out prompts per source, at least.")
@click.option("--max-new-tokens", default=128, type=int, help="Generated tokens per prompt.")
@click.option("--gen-batch", default=32, type=int)
@click.option("--samples-per-prompt", default=1, type=int,
              help="Extra sampled continuations per train prompt.")
@click.option("--temperature", default=0.8, type=float, help="For the sampled continuations.")
@click.option("--second-turns/--no-second-turns", default=True,
              help="Also generate MT-Bench second-turn answers.")
@click.option("--corpus-tokens", default=150_000, type=int,
              help="Teacher-forced tokens from local text files (0 = none).")
@click.option("--corpus-dir", "corpus_dirs", multiple=True, type=click.Path(file_okay=False, exists=True),
              help="Where to read that text (default: stdlib + site-packages).")
@click.option("--chunk-tokens", default=256, type=int)
@click.option("--topk", default=64, type=int, help="Teacher top-k kept per position.")
@click.option("--epochs", default=4.0, type=float)
@click.option("--max-steps", default=0, type=int, help="Stop after N steps (0 = epochs).")
@click.option("--batch-tokens", default=2048, type=int)
@click.option("--lr", default=5e-4, type=float)
@click.option("--warmup", default=30, type=int)
@click.option("--ckpt-every", default=50, type=int)
@click.option("--eval/--no-eval", "do_eval", default=True, help="Held-out evaluation.")
@click.option("--eval-max-new-tokens", default=128, type=int)
@click.option("--eval-depth", default=4, type=int)
@click.option("--save-dtype", type=click.Choice(["float16", "bfloat16", "float32"]),
              default="float16")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def distill_command(**kw):
    """Train a draft for TARGET by KL distillation and write it to --out.

    \b
    Example (the committed demo draft):
      specrelay draft distill --target smollm2-135m \\
        --out edge_sdk/assets/drafts/smollm2-135m-draft --work-dir distill-work
    Load it with exporters.distill.load_draft(OUT) or edge_sdk.models.load_model(OUT).
    """
    do_eval = kw.pop("do_eval")
    quiet = kw.pop("quiet")
    kw["prompts_files"] = list(kw["prompts_files"])
    kw["corpus_dirs"] = list(kw["corpus_dirs"])
    cfg = DistillConfig(**kw, eval=do_eval, progress=not quiet)
    res = run_distill(cfg)
    click.echo(json.dumps({k: res[k] for k in ("heldout", "speed", "wall_seconds")
                           if k in res}, indent=1))
