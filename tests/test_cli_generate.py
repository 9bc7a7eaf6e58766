"""``specrelay generate/demo`` options for depth control and proactive drafting (issue #5):
the CLI's generation path with each controller / proactive mode / the n-gram drafter
gives the target-only tokens (greedy), through the real server."""

from __future__ import annotations

import asyncio

import pytest
from click.testing import CliRunner

import specrelay_cli
from specrelay_cli.generate import run_generation
from edge_sdk.drafters.torch import TorchDrafter

BASE = dict(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0, seed=0,
            max_new_tokens=20, depth=3, stop=(), mode="asym", target_only=False, chat=False,
            as_json=True, controller="fixed", proactive="off", proactive_roots=1,
            ngram=False)


@pytest.mark.parametrize("opts", [
    {"controller": "caac"}, {"controller": "heuristic"}, {"controller": "ucb-specstop"},
    {"proactive": "ipdg", "proactive_roots": 2}, {"controller": "caac", "proactive": "npdg"},
    {"ngram": True}, {"depth": 1}],
    ids=["caac", "heuristic", "ucb", "ipdg-tree", "caac-npdg", "ngram", "depth1"])
def test_cli_generation_options_keep_the_target_output(opts, server, target, draft, tok):
    prompt = "w5 w9 w12 w3 w7 w5 w9"
    ref = asyncio.run(run_generation(server.url, None, tok, prompt,
                                      BASE | {"target_only": True}, None))
    res = asyncio.run(run_generation(server.url, TorchDrafter(draft), tok, prompt,
                                      BASE | opts, None))
    assert res.token_ids == ref.token_ids and len(ref.token_ids) == 20
    if opts.get("proactive") in ("ipdg", "npdg"):
        assert res.metrics["proactive_rounds"] > 0


def test_cli_help_lists_the_options():
    for cmd in ("generate", "demo"):
        out = CliRunner().invoke(specrelay_cli.main, [cmd, "--help"]).output
        for opt in ("--controller", "--proactive", "--proactive-roots", "--ngram"):
            assert opt in out, (cmd, opt)


def test_text_output_says_when_the_token_limit_cut_the_answer(server, target, draft, tok,
                                                              capsys):
    """A human-readable result cut by --max-new-tokens says so (a demo answer that
    stops mid-line otherwise looks broken); the JSON form stays one object."""
    from specrelay_cli.generate import print_result

    res = asyncio.run(run_generation(server.url, TorchDrafter(draft), tok,
                                     "w5 w9 w12 w3 w7 w5 w9", BASE, None))
    assert res.finish_reason == "length"
    print_result(res, False, "demo")
    out = capsys.readouterr().out
    assert "finish_reason=length" in out and "raise it for the whole answer" in out
    print_result(res, True, "demo")
    assert "raise it" not in capsys.readouterr().out
