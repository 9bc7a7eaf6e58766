"""Verdict-paced draft depth (``controller="paced"``): as many draft tokens as one
verification round trip hides, ``round(T / tau)`` clamped to ``1..depth``. The rule on
synthetic round records, then through the real server behind a 50 ms RTT link with a
fast and a slowed draft (the tiny pair)."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import pytest

from edge_sdk import EdgeClient
from edge_sdk.control import PacedDepth, RoundRecord, make_controller
from edge_sdk.drafters.torch import TorchDrafter

from conftest import tiny_model
from test_proactive import SlowDrafter

PROMPTS = [[5, 9, 11], [7, 3], [12, 40, 2, 8]]


def _rec(depth=4, tau=0.03, resp=0.24, proactive=False, accepted=4):
    return RoundRecord(depth=depth, accepted=min(accepted, depth), committed=1,
                       draft_s_per_token=tau if depth else None, resp_s=resp,
                       proactive=proactive)


def test_depth_is_the_round_trip_over_the_draft_time():
    c = make_controller("paced")
    assert isinstance(c, PacedDepth) and c.next_depth() == 8      # nothing measured yet
    c.update(_rec(tau=0.028, resp=0.242))                          # quiet: T / tau = 8.6
    assert c.next_depth() == 8
    slow = PacedDepth()
    slow.update(_rec(tau=0.089, resp=0.211))                       # 3x slower: 2.4
    assert slow.next_depth() == 2
    slow.update(_rec(tau=2.0, resp=0.2))                           # far slower: l_min
    assert slow.next_depth() == 1
    assert PacedDepth(depth=6).next_depth() == 6
    deep = PacedDepth(depth=12)
    deep.update(_rec(tau=0.02, resp=0.2))
    assert deep.next_depth() == 10


def test_blocks_sent_ahead_and_target_steps_do_not_set_the_round_trip():
    c = PacedDepth()
    c.update(_rec(tau=0.05, resp=0.2))
    c.update(_rec(tau=0.05, resp=5.0, proactive=True))     # waited behind its predecessor
    c.update(_rec(depth=0, resp=0.01))                     # a target step: no block
    assert c.t_resp == pytest.approx(0.2) and c.next_depth() == 4
    c.update(_rec(tau=0.1, resp=0.2))                      # EWMA, weight 0.3
    assert c.tau == pytest.approx(0.065) and c.next_depth() == 3


def test_an_exposed_block_is_short_and_others_keep_the_paced_depth():
    from edge_sdk.control import PlanContext

    c = PacedDepth()
    assert c.next_depth(PlanContext(exposed=True)) == 4            # before any measurement
    c.update(_rec(tau=0.028, resp=0.242))
    assert c.next_depth(PlanContext(exposed=True)) == 4
    assert c.next_depth(PlanContext(proactive=True)) == 8
    assert c.next_depth(PlanContext()) == 8 and c.next_depth() == 8
    slow = PacedDepth()
    slow.update(_rec(tau=0.089, resp=0.211))                       # L = 2 < fresh
    assert slow.next_depth(PlanContext(exposed=True)) == 2
    assert PacedDepth(fresh=None).next_depth(PlanContext(exposed=True)) == 8
    assert PacedDepth(fresh=5, l_min=6, depth=8).next_depth(PlanContext(exposed=True)) == 6


def test_bad_arguments():
    for kw in ({"depth": 0}, {"l_min": 0}, {"depth": 2, "l_min": 3}, {"w": 0.0}, {"w": 1.5},
               {"fresh": 0}):
        with pytest.raises(ValueError):
            PacedDepth(**kw)


@pytest.fixture(scope="module")
def close_draft(target):
    """A draft that agrees with the target's greedy choice ~80 % of the time."""
    return tiny_model(seed=3, like=target, noise=0.002)


def _depths(url, tok, drafter, fresh=None):
    from bench.linkem.emulator import LinkEmulatorThread
    from bench.linkem.profiles import Profile

    async def go(base):
        async with EdgeClient(base, drafter, tok, chat=False, controller="paced",
                              controller_kw={"fresh": fresh}, proactive="ipdg",
                              send_ahead=True) as c:
            refs = [await c.generate(prompt_ids=p, target_only=True, max_new_tokens=40)
                    for p in PROMPTS]
            outs = [await c.generate(prompt_ids=p, max_new_tokens=40) for p in PROMPTS]
            return refs, outs

    u = urlsplit(url)
    with LinkEmulatorThread(u.hostname, u.port, Profile("rtt50", None, None, 0.05)) as em:
        refs, outs = asyncio.run(go(f"http://{em.host}:{em.port}"))
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    # the first request measures; the controller carries its estimates to the next ones
    return [d for o in outs[1:] for d in o.metrics["depth_hist"] if d > 0]


def test_a_slow_draft_gets_short_blocks_and_a_fast_one_the_full_depth(server, tok,
                                                                       close_draft):
    """Round trip ~50 ms: a draft token costing ~30 ms more gives blocks of 1-2 tokens,
    an unslowed one (a few ms per token) blocks of 8; the output is the target's."""
    slow = _depths(server.url, tok, SlowDrafter(close_draft, 0.03))
    fast = _depths(server.url, tok, TorchDrafter(close_draft))
    assert slow and sorted(slow)[len(slow) // 2] <= 3
    assert fast and sorted(fast)[len(fast) // 2] == 8


def test_blocks_after_a_miss_are_short_through_the_server(server, tok, close_draft):
    """The default paced controller drafts 4 tokens after a miss (nothing in flight)
    and the paced depth, 8 here, ahead of a block in flight; the output is the
    target's."""
    short = _depths(server.url, tok, TorchDrafter(close_draft), fresh=4)
    full = _depths(server.url, tok, TorchDrafter(close_draft), fresh=None)
    assert max(short) == 8 and max(full) == 8
    # full blocks are 8 or cut to the tokens left; the short ones add the 4s
    assert short.count(4) >= full.count(4) + 2


def test_the_exposed_block_model_trades_passes_for_rate():
    """bench.probes.exposed_block: a short block after a miss is faster than a full one
    and costs more target passes per token; the longer, the fewer passes."""
    from bench.probes.exposed_block import simulate

    full = simulate(0.9, 0.038, 0.30, 0.025, 8, 8, tokens=8000)
    four = simulate(0.9, 0.038, 0.30, 0.025, 8, 4, tokens=8000)
    two = simulate(0.9, 0.038, 0.30, 0.025, 8, 2, tokens=8000)
    assert four[0] > 1.03 * full[0]
    assert full[1] < four[1] < two[1]


def test_round_pacing_reads_cycles_and_exposed_drafting_from_traces():
    """bench.probes.round_pacing: per (mode, profile, workload) the medians of a
    request's round cycle and its parts, and the seconds drafted with nothing in flight
    (positive verdict -> next send gaps; a block sent ahead has a negative one)."""
    from bench.probes.round_pacing import cycles, pacing

    def rnd(send, resp, depth=4, proactive=False, ready=None, steps=None, accepted=4):
        return {"t_send": send, "t_response": resp, "depth": depth, "accepted": accepted,
                "proactive_block": proactive, "t_ready": ready, "proactive_steps": steps}
    trace = [rnd(1.0, 1.4, ready=1.3, steps=4), rnd(1.3, 1.8, proactive=True, accepted=1),
             rnd(2.0, 2.4, accepted=0), rnd(2.5, 2.9)]
    rows = [{"mode": "m", "profile": "p", "workload": "w",
             "metrics": {"wall_s": 3.0, "ttft_s": 0.5, "round_trace": trace,
                         "ahead_blocks": 2, "ahead_hits": 1, "proactive_hits": 1}}]
    (c,) = cycles(rows).values()
    assert c["rounds"] == 3 and c["decode_s"] == 2.5
    assert c["cycle_s"] == 0.5                           # 0.4, 0.6, 0.5
    assert c["send_to_verdict_s"] == 0.4                 # 0.5, 0.4, 0.4
    assert c["verdict_to_send_s"] == 0.1                 # -0.1 (sent ahead), 0.2, 0.1
    assert c["exposed_drafting_s"] == 0.3                # 0.2 + 0.1
    # after the hit (round 1): -0.1; after the misses (rounds 2, 3): 0.2 and 0.1
    assert c["after_hit_s"] == -0.1 and c["after_miss_s"] == 0.15 and c["misses"] == 2
    assert (c["ahead_blocks"], c["ahead_hits"], c["proactive_hits"]) == (2, 1, 1)
    (p,) = pacing(rows).values()
    assert p["T_s"] == 0.4 and p["tau_s"] == 0.075       # (1.3 - 1.0) / 4
