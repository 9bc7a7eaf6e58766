"""What the commands share: the default model pair, the target dtype option, the
sampling and decoding options of ``generate``/``demo``, and the drafter builder.

Nothing here imports torch or the SDK's client at import time (``specrelay --help``
stays fast)."""

from __future__ import annotations

import click

from edge_sdk.defaults import (DEFAULT_DEPTH, DEFAULT_PROACTIVE, DEFAULT_PROACTIVE_MIN_HIT,
                               DEFAULT_SIBLINGS)
from edge_sdk.protocol.limits import (MAX_DRAFT_TOKENS, MAX_NEW_TOKENS, MAX_PROACTIVE_ROOTS,
                                      MAX_SIBLINGS)

#: The default pair (kept in step with ``edge_sdk.models.DEFAULT_TARGET/DEFAULT_DRAFT``,
#: which this module does not import at start-up to keep ``--help`` fast).
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b+onnx-int4"
#: SmolLM2-135M and its trained 6-layer draft: the small pair of the fast tests.
SMOLLM2_TARGET, SMOLLM2_DRAFT = "smollm2-135m", "smollm2-135m-draft"


def default_draft(target: str | None = None) -> str:
    """The draft paired with ``target`` (``edge_sdk.models.default_draft``)."""
    from edge_sdk import models

    return models.default_draft(target)


class SiblingsParam(click.ParamType):
    """``--siblings``: ``auto`` (the SDK's default: width 2 within the rows the server
    advertises as free) or a width 0..MAX_SIBLINGS (0: chains only)."""

    name = "auto|0..%d" % MAX_SIBLINGS

    def convert(self, value, param, ctx):
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        if not (text.isdigit() and int(text) <= MAX_SIBLINGS):
            self.fail(f"{value!r} is not 'auto' or a width in 0..{MAX_SIBLINGS}", param, ctx)
        return int(text)


DTYPE_CHOICE = ["auto", "float32", "bfloat16"]
DTYPE_HELP = ("Target dtype. auto = bfloat16 where the CPU has AMX/AVX512-BF16 (a 9-token "
              "verify pass then costs about a 1-token one; verify passes are row-invariant, "
              "so greedy output is target-only's bit for bit, and any near-tie divergence "
              "would be counted), else float32 (exact greedy identity up to 1e-4 ties).")


def make_drafter(spec: str):
    """A drafter from a model spec with an optional runtime suffix
    (``qwen2.5-coder-0.5b+onnx-int4``; ``edge_sdk.drafters.runtime``), or an ONNX export
    folder (``specrelay_onnx.json``).

    Returns ``(drafter, tokenizer or None)``; ONNX folders carry no tokenizer (use the
    target's: draft and target share it). A first use of an ONNX runtime exports the
    draft into the cache (~90 s for the 0.5B draft); torch drafts load in ``auto`` dtype
    (bfloat16 where the CPU computes it natively): the draft never touches exactness."""
    from exporters.onnx.first_use import build_drafter

    return build_drafter(spec, dtype="auto", echo=lambda m: click.echo(m, err=True))


SAMPLING_OPTIONS = [
    click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0,
                 show_default=True,
                 help="0 = greedy (token-for-token identical to the target)."),
    click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
                 help="Keep the k most likely tokens (0: all)."),
    click.option("--top-p", type=click.FloatRange(0.0, 1.0, min_open=True),
                 default=1.0, show_default=True,
                 help="Nucleus sampling: the smallest set with this probability mass."),
    click.option("--repetition-penalty", type=click.FloatRange(min=0.0, min_open=True),
                 default=1.0, show_default=True, help="1 = off."),
    click.option("--seed", type=click.IntRange(0, 2 ** 63 - 1), default=None,
                 help="Seed of the edge's and the cloud's draws (same seed, same "
                 "output; default: a fresh one each run, which --json prints)."),
    click.option("--max-new-tokens", type=click.IntRange(1, MAX_NEW_TOKENS), default=96,
                 show_default=True, help=f"Tokens to generate (1..{MAX_NEW_TOKENS})."),
    click.option("--offline-timeout", type=click.FloatRange(min=0.0), default=5.0,
                 show_default=True, help="Seconds to keep retrying an unreachable API "
                 "before giving up."),
    click.option("--depth", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=DEFAULT_DEPTH,
                 show_default=True, help="Draft depth (tokens per block; with "
                 "--controller paced the deepest block). 8 led 6 and 12 on the default "
                 "pair across chat and code (README benchmark)."),
    click.option("--controller", type=click.Choice(["auto", "fixed", "heuristic", "caac",
                                                   "ucb-specstop", "paced"]),
                 default="auto", show_default=True,
                 help="Draft-depth policy. auto: paced for greedy requests (as many "
                 "drafts as a verification round trip hides, at most --depth), fixed "
                 "--depth for sampled ones; fixed: always --depth; caac (RAPID), "
                 "ucb-specstop, heuristic."),
    click.option("--proactive", type=click.Choice(["off", "ipdg", "npdg", "fsd", "fsd+ipdg"]),
                 default=DEFAULT_PROACTIVE, show_default=True, help="Draft the next block while "
                 "one is verified (RAPID): ipdg interruptible, npdg not, off: "
                 "stop-and-wait; fsd: from the early verdict the server streams (FSD; a "
                 "server with --early-exit), fsd+ipdg: IPDG steered by it."),
    click.option("--send-ahead/--no-send-ahead", default=True, show_default=True,
                 help="Pipelined verification: send a proactive block before the "
                 "previous verdict (the cloud verifies it only if its assumed prefix "
                 "is confirmed). Needs --proactive other than off."),
    click.option("--proactive-roots", type=click.IntRange(1, MAX_PROACTIVE_ROOTS),
                 default=1, show_default=True, help="Guessed bonus tokens (b > 1: a tree)."),
    click.option("--proactive-min-hit", type=click.FloatRange(0.0, 1.0, max_open=True),
                 default=DEFAULT_PROACTIVE_MIN_HIT, show_default=True,
                 help="ipdg: skip drafting ahead of a block whose predicted "
                 "whole-block acceptance (product of the draft's probabilities of its "
                 "tokens) is below this; 0: never skip."),
    click.option("--siblings", type=SiblingsParam(), default=DEFAULT_SIBLINGS,
                 show_default=True, help="Greedy token trees: the draft's next-best "
                 "tokens verified beside each draft position it is least sure of, in "
                 "the same target pass. auto: 2 within the rows the server says cost "
                 "nothing (a bf16 target on an AMX CPU), else chains; N: width N "
                 "whatever the rows cost; 0: chains only."),
    click.option("--ngram", is_flag=True, help="Prompt-lookup n-gram drafts in front "
                 "of the model draft."),
    click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    click.option("--mode", type=click.Choice(["asym", "standard"]), default="asym",
                 show_default=True, help="asym: compact protocol; standard: baseline "
                 "uploading the full draft distribution."),
    click.option("--acceptance", type=click.Choice(["exact", "semantic"]), default="exact",
                 show_default=True, help="exact: the target's output; semantic: WISV's "
                 "lossy acceptance (the server's decision head may accept a draft token "
                 "the target would not have chosen; greedy only, the output is flagged "
                 "not exact)."),
    click.option("--target-only", is_flag=True,
                 help="Generate with the target alone (the identity reference)."),
    click.option("--chat/--no-chat", default=True, show_default=True,
                 help="Wrap the prompt in the chat template."),
    click.option("--json", "as_json", is_flag=True, help="Print one JSON object."),
]
"""The options of ``generate`` and ``demo``, in their ``--help`` order."""


def sampling_options(f):
    """Decorate a command with :data:`SAMPLING_OPTIONS`."""
    for o in reversed(SAMPLING_OPTIONS):
        f = o(f)
    return f


def sampling_config(kw: dict):
    """The :class:`edge_sdk.SamplingConfig` of the parsed options (raises ValueError on
    values it refuses, click.BadParameter for ``--acceptance semantic`` with sampling)."""
    from edge_sdk import SamplingConfig

    cfg = SamplingConfig(temperature=kw["temperature"], top_k=kw["top_k"], top_p=kw["top_p"],
                         repetition_penalty=kw["repetition_penalty"])
    if kw.get("acceptance", "exact") == "semantic" and not cfg.greedy:
        raise click.BadParameter("semantic acceptance needs greedy decoding "
                                 "(--temperature 0)", param_hint="--acceptance")
    return cfg
