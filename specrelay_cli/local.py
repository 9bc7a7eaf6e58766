"""``specrelay generate --local``: the target on this device under a memory budget, no
cloud (CATS self-speculative decoding, ``edge_sdk.local_target``)."""

from __future__ import annotations

import json
import time

import click

__all__ = ["LOCAL_OPTIONS", "run_local", "calibration"]

LOCAL_OPTIONS = [
    click.option("--local", is_flag=True, help="Run the target on this device (no cloud) "
                 "under --memory-budget, with CATS self-speculative decoding."),
    click.option("--memory-budget", default="1.0", show_default=True,
                 help="--local: memory for the target: bytes (1.5GB, 800MB) or a "
                 "fraction of its weights (0.5)."),
    click.option("--storage", default="nvme", show_default=True,
                 help="--local: emulated storage of the offloaded layers: nvme (2 GB/s), "
                 "emmc (400 MB/s), ram (unthrottled) or <rate>MB/s."),
    click.option("--local-target", default="qwen2.5-coder-1.5b", show_default=True,
                 help="--local: the target preset (its cached safetensors file is the "
                 "storage)."),
    click.option("--local-method", type=click.Choice(["cats", "ar"]), default="cats",
                 show_default=True, help="--local: cats, or ar (the offloaded target "
                 "alone, one streamed pass per token)."),
]



def _draft_label(p) -> str:
    """``exit layer E``, ``skip draft R1+R2`` or the skip draft's resident set."""
    from edge_sdk.local_target.budget import draft_label

    return draft_label(p)

def calibration(tokenizer) -> list[list[int]]:
    """Held-out HumanEval/MT-Bench sequences to fit the exit head once (the cloud's FSD
    calibration text)."""
    from cloud_api.exit_fit import calibration_text

    return calibration_text(tokenizer)


def run_local(prompt: str, kw: dict) -> None:
    """Build the local session, generate ``prompt``, print text + metrics (or JSON)."""
    from edge_sdk.local_target.session import build_local
    from edge_sdk.local_target.storage import parse_profile
    from edge_sdk.models import encode_prompt
    from specrelay_cli.options import sampling_config

    cfg = sampling_config(kw)
    try:
        parse_profile(kw["storage"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--storage") from None
    try:
        sess = build_local(kw["local_target"], kw["memory_budget"], kw["storage"],
                           method=kw["local_method"], calibration=calibration)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--memory-budget") from None
    tok = sess.local.tokenizer
    ids = encode_prompt(tok, prompt, kw["chat"])
    t0 = time.perf_counter()
    out, st = sess.generate(ids, kw["max_new_tokens"], cfg, kw["seed"])
    text = tok.decode(out, skip_special_tokens=True)
    for s in kw.get("stop") or ():
        text = text.split(s, 1)[0]
    res = {"text": text, "token_ids": out, "verified": True, "seed": kw["seed"],
           "local": sess.describe(),
           "metrics": st.to_dict() | {"wall_s": time.perf_counter() - t0}}
    if kw["as_json"]:
        click.echo(json.dumps(res))
        return
    p = sess.plan
    click.echo(text)
    click.echo(f"-- local {sess.method}: R={p.resident_layers}/{sess.local.target.num_layers} "
               f"resident, {_draft_label(p)}, depth {sess.depth or p.depth}"
               + (f" (trees {res['local']['beam']}x{res['local']['nodes']})"
                  if res["local"].get("beam", 1) > 1 else "") + ", budget "
               f"{p.budget / 1e9:.2f} GB (plan {p.memory / 1e9:.2f} GB), storage "
               f"{kw['storage']}", err=True)
    m = res["metrics"]
    click.echo(f"-- {m['committed']} tokens in {m['seconds']:.1f} s = "
               f"{m['throughput_tok_s']:.2f} tok/s, acceptance {m['acceptance_rate']:.2f}, "
               f"{m['mean_accepted_length']:.2f} tokens/pass", err=True)
