"""IPDG / NPDG (SPEC §5) and depth controllers inside the edge client.

* greedy identity with every controller, with IPDG/NPDG on (chains and trees) and with
  the n-gram drafter;
* IPDG stops at the first expansion step after the verdict, NPDG runs to the plan;
* sampling: IPDG output equals stop-and-wait output seed by seed (on a hit the branch
  drew exactly the tokens a fresh draft from the true prefix would), and the first-3-token
  distribution with IPDG on equals the target's (in-process, chi-square).
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from cloud_api.service import CloudService
from cloud_api.inprocess import InProcessTransport
from edge_sdk import EdgeClient, SamplingConfig
from edge_sdk.control import CAAC, CONTROLLERS, FixedDepth
from edge_sdk.drafters.ngram import NgramDrafter
from edge_sdk.drafters.torch import TorchDrafter
from tests.conftest import tiny_model, tiny_tokenizer

PROMPT = [5, 9, 11]


class SlowTransport(InProcessTransport):
    """Verify answers arrive ``delay_s`` after the request (a network round trip)."""

    def __init__(self, svc, delay_s: float):
        super().__init__(svc)
        self.delay_s = delay_s

    async def request(self, method, path, body=b"", content_type=""):
        if path.endswith("/verify"):
            await asyncio.sleep(self.delay_s)
        return await super().request(method, path, body)


class SlowDrafter(TorchDrafter):
    """A torch drafter whose every forward takes at least ``step_s`` seconds."""

    def __init__(self, model, step_s: float):
        super().__init__(model)
        self.step_s = step_s

    def _slow(self, x):
        time.sleep(self.step_s)
        return x

    def sync(self, context):
        return self._slow(super().sync(context))

    def step(self, token):
        return self._slow(super().step(token))

    def fork(self):
        return SlowDrafter(self.kv.model, self.step_s)


@pytest.fixture(scope="module")
def close_draft(target):
    return tiny_model(seed=1, like=target, noise=0.01)


@pytest.fixture(scope="module")
def svc(target, tok):
    """A factory: a CloudService's verify queue binds to the event loop it first runs
    in, so every ``asyncio.run`` gets its own service (sharing the target model)."""
    return lambda: CloudService(target, tok)


@pytest.fixture(scope="module")
def reference(svc, tok):
    return generate(svc, None, tok, delay_s=0.0).token_ids


def generate(svc, drafter, tok, delay_s=0.002, n=40, prompt=PROMPT, **kw):
    gen_kw = {k: kw.pop(k) for k in ("sampling", "seed") if k in kw}
    # each test names the policy it checks: stop-and-wait at depth 4, no send-ahead
    # unless asked (the SDK's defaults are checked on their own below)
    kw.setdefault("depth", 4)
    kw.setdefault("proactive", "off")
    kw.setdefault("send_ahead", False)

    trace: list[dict] = []

    async def main():
        async with EdgeClient("inproc://", drafter, tok, chat=False,
                              transport=SlowTransport(svc(), delay_s), **kw) as c:
            return await c.generate(prompt_ids=prompt, max_new_tokens=n,
                                    on_round=trace.append, **gen_kw)
    out = asyncio.run(main())
    out.metrics["round_trace"] = trace      # the on_round records, for the assertions
    return out


# ----------------------------------------------------------------------------- greedy

@pytest.mark.parametrize("proactive", ["off", "ipdg", "npdg"])
@pytest.mark.parametrize("controller", sorted(CONTROLLERS))
def test_greedy_identity_every_controller(svc, tok, close_draft, reference, controller,
                                          proactive):
    out = generate(svc, TorchDrafter(close_draft), tok, controller=controller,
                   proactive=proactive)
    assert out.token_ids == reference
    m = out.metrics
    assert m["drafted_tokens"] > 0 and all(0 <= d <= 8 for d in m["depth_hist"])  # 0: cap
    if proactive != "off":
        assert m["proactive_rounds"] > 0 and m["proactive_hits"] > 0
        assert 0 < m["proactive_hit_rate"] <= 1
        assert m["wasted_draft_tokens"] == (m["drafted_tokens"] - m["accepted_tokens"]
                                            + m["proactive_wasted_tokens"])
        assert any(r["proactive_block"] for r in m["round_trace"])


@pytest.mark.parametrize("roots", [2, 3])
@pytest.mark.parametrize("proactive", ["ipdg", "npdg"])
def test_greedy_identity_trees(svc, tok, draft, reference, roots, proactive):
    """Top-b roots (a tree of b branches on drafter forks), with a draft that misses
    often enough for non-first roots to hit."""
    out = generate(svc, TorchDrafter(draft), tok, controller="caac", proactive=proactive,
                   proactive_roots=roots, delay_s=0.005)
    assert out.token_ids == reference
    assert out.metrics["proactive_rounds"] > 0


@pytest.mark.parametrize("proactive", ["off", "ipdg"])
def test_greedy_identity_ngram(svc, tok, target, draft, proactive):
    rep = [5, 9, 11, 5, 9, 11, 5, 9]
    expect = generate(svc, None, tok, delay_s=0.0, n=30, prompt=rep).token_ids
    for drafter in (NgramDrafter(64), NgramDrafter(base=TorchDrafter(draft))):
        out = generate(svc, drafter, tok, n=30, prompt=rep, controller="heuristic",
                       proactive=proactive)
        assert out.token_ids == expect and out.metrics["drafted_tokens"] > 0


def test_shared_controller_object_and_factory(svc, tok, close_draft, reference):
    shared = CAAC()
    out = generate(svc, TorchDrafter(close_draft), tok, controller=shared, proactive="ipdg")
    assert out.token_ids == reference and shared.rounds > 0 and shared.tau_f > 0
    out = generate(svc, TorchDrafter(close_draft), tok, controller=lambda: FixedDepth(2))
    assert out.token_ids == reference and set(out.metrics["depth_hist"]) <= {1, 2}
    with pytest.raises(ValueError):
        EdgeClient("http://127.0.0.1:9", None, tok, controller="nope")
    with pytest.raises(ValueError):
        EdgeClient("http://127.0.0.1:9", None, tok, proactive="maybe")


@pytest.mark.parametrize("carry", [True, False])
def test_named_controller_carries_over_requests(svc, tok, close_draft, reference, carry):
    """A registry-named controller of a request starts from the state the client's last
    finished request left (device/link/acceptance estimates), or cold with
    ``carry_controller=False``; the output is the target's either way."""
    seen: list[CAAC] = []

    async def main():
        async with EdgeClient("inproc://", TorchDrafter(close_draft), tok, chat=False,
                              transport=SlowTransport(svc(), 0.002), controller="caac",
                              carry_controller=carry) as c:
            outs = []
            for _ in range(2):
                g = c.stream(prompt_ids=PROMPT, max_new_tokens=40)
                seen.append(g.ctrl)
                rounds0 = g.ctrl.rounds
                async for _ev in g:
                    pass
                outs.append((rounds0, g.ctrl.rounds, g.result().token_ids))
            return outs

    (r0a, r1a, ids_a), (r0b, r1b, ids_b) = asyncio.run(main())
    assert ids_a == ids_b == reference
    assert r0a == 0 and r1a > 0
    assert seen[0] is not seen[1]                  # a copy: requests never share one
    if carry:
        assert r0b == r1a and r1b > r1a            # warm: continues the first's count
    else:
        # cold: counts from zero again (the exact round count depends on measured timings)
        assert r0b == 0 and r1b > 0
        assert seen[1].rounds == r1b


# ----------------------------------------------------------------------------- mechanism

def test_ipdg_stops_after_verdict_npdg_runs_to_plan(tok, target, close_draft):
    """Draft forwards take 20 ms, the verdict 30 ms: IPDG checks after each complete
    step and starts none after the verdict; NPDG runs all planned steps."""
    res = {}
    for mode in ("ipdg", "npdg"):
        out = generate(lambda: CloudService(target, tok), SlowDrafter(close_draft, 0.02),
                       tok, delay_s=0.03, n=24,
                       depth=8, proactive=mode)
        res[mode] = out.metrics
    ipdg = [r for r in res["ipdg"]["round_trace"] if r["proactive_steps"] is not None]
    npdg = [r for r in res["npdg"]["round_trace"] if r["proactive_steps"] is not None]
    assert ipdg and npdg
    assert res["ipdg"]["proactive_late_steps"] == 0
    assert res["npdg"]["proactive_late_steps"] > 0
    assert max(r["proactive_steps"] for r in ipdg) <= 3
    assert all(r["proactive_steps"] == r["proactive_plan"] for r in npdg)
    assert any(r["proactive_steps"] < r["proactive_plan"] for r in ipdg)
    assert max(r["proactive_steps"] for r in npdg) >= 6
    # IPDG is ready soon after the verdict; NPDG only after finishing its plan
    lag = lambda rs: np.mean([r["t_ready"] - r["t_response"] for r in rs])  # noqa: E731
    assert lag(ipdg) < lag(npdg)


def test_hit_chance_is_the_product_of_the_drafts_own_probabilities():
    from edge_sdk.drafters.base import DraftBlock
    from edge_sdk.proactive import hit_chance

    greedy = DraftBlock([1, 2, 3], torch.ones(3, dtype=torch.float64), None,
                        cands=[[4], [5], [6]], conf=[0.9, 0.5, 0.8])
    assert hit_chance(greedy) == pytest.approx(0.36)
    sampled = DraftBlock([1, 2], torch.tensor([0.5, 0.25], dtype=torch.float64), None)
    assert hit_chance(sampled) == pytest.approx(0.125)
    assert hit_chance(DraftBlock([], torch.zeros(0, dtype=torch.float64), None)) == 1.0


def test_ipdg_skips_branches_of_blocks_predicted_to_miss(svc, tok, close_draft, reference):
    """min_hit: IPDG drafts ahead only after blocks whose product of draft
    probabilities reaches it; a skipped round drafts nothing proactively, and the
    output is the target's whatever the threshold."""
    m = {}
    for min_hit in (0.0, 0.5, 0.999):
        out = generate(svc, TorchDrafter(close_draft), tok, depth=6, proactive="ipdg",
                       proactive_min_hit=min_hit)
        assert out.token_ids == reference
        m[min_hit] = out.metrics
    assert m[0.0]["proactive_skipped"] == 0 and m[0.0]["proactive_drafted_tokens"] > 0
    assert m[0.5]["proactive_skipped"] > 0
    assert m[0.5]["proactive_drafted_tokens"] < m[0.0]["proactive_drafted_tokens"]
    # a tiny random pair is never that sure of a whole block: nothing drafted ahead
    assert m[0.999]["proactive_skipped"] > 0 and m[0.999]["proactive_drafted_tokens"] == 0
    assert m[0.999]["rounds"] > 3


def test_min_hit_out_of_range_or_without_ipdg(tok):
    for bad in (-0.1, 1.0, 2):
        with pytest.raises(ValueError, match="proactive_min_hit"):
            EdgeClient("http://127.0.0.1:9", None, tok, proactive_min_hit=bad)
    # NPDG (the baseline) never skips; FSD drafts from the early verdict; off drafts
    # nothing ahead: a threshold there would be silently ignored, so it is refused
    for mode in ("npdg", "fsd", "fsd+ipdg", "off"):
        with pytest.raises(ValueError, match="proactive_min_hit needs"):
            EdgeClient("http://127.0.0.1:9", None, tok, proactive=mode, proactive_min_hit=0.3)
    EdgeClient("http://127.0.0.1:9", None, tok, proactive="npdg", proactive_min_hit=0.0)


# ----------------------------------------------------------------------------- sampling

def test_ipdg_sampling_equals_stop_and_wait_seed_by_seed(svc, tok, close_draft):
    """Same seed, same fixed depth: IPDG (chain and tree) commits exactly the tokens
    stop-and-wait commits — the proactive branch drew what a fresh draft would have."""
    cfg = SamplingConfig(temperature=0.9)
    hits = 0
    for seed in range(4):
        base = generate(svc, TorchDrafter(close_draft), tok, n=16, depth=2, sampling=cfg,
                        seed=seed)
        for roots in (1, 2):
            out = generate(svc, TorchDrafter(close_draft), tok, n=16, depth=2, sampling=cfg,
                           seed=seed, proactive="ipdg", proactive_roots=roots)
            assert out.token_ids == base.token_ids
            hits += out.metrics["proactive_hits"]
    assert hits > 0


V3 = 8
PROMPT3 = [3, 5, 7]


def exact_triples(model, cfg) -> np.ndarray:
    from edge_sdk.protocol import sampling as S
    with torch.inference_mode():
        l1 = model(torch.tensor([PROMPT3])).logits[0, -1]
        l2 = model(torch.tensor([PROMPT3 + [a] for a in range(V3)])).logits[:, -1]
        l3 = model(torch.tensor([PROMPT3 + [a, b] for a in range(V3)
                                 for b in range(V3)])).logits[:, -1]
    p1, p2, p3 = (S.probs_from_logits(x, cfg) for x in (l1, l2, l3))
    return (p1[:, None, None] * p2.reshape(V3, V3, 1) * p3.reshape(V3, V3, V3)).reshape(-1)


def ipdg_counts(n: int, cfg: SamplingConfig, roots: int):
    """First-3-token counts of ``n`` IPDG generations (depth 1, 4 tokens: the second
    block is drafted proactively while the first one's verdict is awaited), the exact
    target distribution, and the number of proactive hits."""
    tk = tiny_tokenizer(V3)
    tgt = tiny_model(vocab=V3, seed=0)
    tgt.generation_config.eos_token_id = None
    dft = tiny_model(vocab=V3, seed=1, like=tgt, noise=0.005)
    exact = exact_triples(tgt, cfg).numpy()

    async def main():
        svc = CloudService(tgt, tk)
        svc.eos = []
        counts, hits, rounds, stepped = np.zeros(V3 ** 3), 0, 0, 0
        async with EdgeClient("inproc://", TorchDrafter(dft), tk, chat=False, depth=1,
                              support_k=V3, proactive="ipdg", proactive_roots=roots,
                              transport=SlowTransport(svc, 0.0)) as c:
            for seed in range(n):
                trace: list[dict] = []
                r = await c.generate(prompt_ids=PROMPT3, sampling=cfg, seed=seed,
                                     max_new_tokens=4, on_round=trace.append)
                a, b, d = r.token_ids[:3]
                counts[(a * V3 + b) * V3 + d] += 1
                hits += r.metrics["proactive_hits"]
                rounds += r.metrics["proactive_rounds"]
                stepped += any(t["proactive_steps"] for t in trace
                               if t["proactive_steps"] is not None)
        return counts, hits, rounds, stepped

    counts, hits, rounds, stepped = asyncio.run(main())
    assert rounds >= n and hits > 0.1 * n and stepped > 0
    return counts, exact


def test_ipdg_distribution_in_process():
    """2,000 IPDG generations: the first-3-token distribution equals the target's
    (chi-square p > 0.01). The seed-by-seed test above shows IPDG output is exactly
    stop-and-wait output; 10,000-draw versions (chain and tree) are marked slow."""
    from tests.test_e2e_distribution import pvalue

    counts, exact = ipdg_counts(2000, SamplingConfig(temperature=1.0), 1)
    assert pvalue(counts, exact) > 0.01


@pytest.mark.slow
@pytest.mark.parametrize("cfg,roots", [(SamplingConfig(temperature=1.0), 1),
                                       (SamplingConfig(temperature=0.8, top_k=4), 2)],
                         ids=["t1.0-chain", "topk4-tree2"])
def test_ipdg_distribution_in_process_10k(cfg, roots):
    from tests.test_e2e_distribution import pvalue

    counts, exact = ipdg_counts(10_000, cfg, roots)
    assert pvalue(counts, exact) > 0.01


# ----------------------------------------------------------------------------- send ahead

@pytest.mark.parametrize("proactive", ["ipdg", "npdg"])
@pytest.mark.parametrize("controller", ["fixed", "caac"])
def test_send_ahead_greedy_identity(svc, tok, close_draft, draft, reference, proactive,
                                    controller):
    """Pipelined verification: blocks sent before their predecessor's verdict commit the
    target's greedy output; hits are verified ahead, misses refused and redrafted."""
    for d in (close_draft, draft):            # mostly hits / many misses
        # 30 ms each way: a proactive block of the tiny draft completes while its
        # predecessor is in flight even on a loaded CPU (10 ms missed every hit once)
        out = generate(svc, TorchDrafter(d), tok, delay_s=0.03, controller=controller,
                       proactive=proactive, send_ahead=True)
        assert out.token_ids == reference
        m = out.metrics
        assert m["ahead_blocks"] > 0
        assert m["ahead_blocks"] == m["ahead_hits"] + m["ahead_dropped"]
        if d is close_draft:
            assert m["ahead_hits"] > 0
    assert m["ahead_dropped"] > 0                # the far draft misses


def test_send_ahead_sampling_equals_stop_and_wait_seed_by_seed(svc, tok, close_draft):
    """Same seed, same depth: with blocks sent ahead the committed tokens are exactly
    stop-and-wait's (the cloud's per-block draws and the draft's per-round draws do
    not depend on when a block is sent)."""
    cfg = SamplingConfig(temperature=0.9)
    hits = 0
    for seed in range(4):
        base = generate(svc, TorchDrafter(close_draft), tok, n=16, depth=2, sampling=cfg,
                        seed=seed)
        out = generate(svc, TorchDrafter(close_draft), tok, n=16, depth=2, sampling=cfg,
                       seed=seed, delay_s=0.01, proactive="ipdg", send_ahead=True)
        assert out.token_ids == base.token_ids
        hits += out.metrics["ahead_hits"]
    assert hits > 0


def test_send_ahead_stale_block_changes_nothing(target, tok):
    """The cloud side: a block sent ahead on an outcome that did not happen is refused
    with 409 stale_block naming expect_last, before any charge, and the session is as
    before; the same bytes after the right outcome are verified; a retry is replayed."""
    from cloud_api.sessions import ApiError
    from edge_sdk.protocol import wire

    async def main():
        svc = CloudService(target, tok)
        await svc.start()
        info = await svc.create({"prompt_ids": PROMPT, "sampling": {}, "seed": 0,
                                 "max_new_tokens": 8}, None)
        sid = int(info["session_id"])
        first = wire.VerifyRequest(sid, 0, 3, info["config_id"], None,
                                   np.array([], dtype=np.int64), None, None, PROMPT[-1])
        first_out = await svc.verify(str(sid), first.encode(svc.verifier.vocab_size), None)
        ans = wire.VerifyResponse.decode(first_out)
        bonus = ans.next_token
        wrong = (bonus + 1) % svc.verifier.vocab_size
        mk = lambda last: wire.VerifyRequest(sid, 1, 4, info["config_id"], None,  # noqa: E731
                                             np.array([7], dtype=np.int64), None, None,
                                             last).encode(svc.verifier.vocab_size)
        charged = []
        with pytest.raises(ApiError) as e:
            await svc.verify(str(sid), mk(wrong), None, charge=charged.append)
        assert e.value.status == 409 and e.value.code == "stale_block"
        assert e.value.field == "expect_last" and charged == []
        s = svc.sessions.get(str(sid))
        assert s.next_seq == 1 and s.base_len == 4
        out = await svc.verify(str(sid), mk(bonus), None, charge=charged.append)
        assert charged == [2] and await svc.verify(str(sid), mk(bonus), None) == out
        # the block before the sent-ahead one is still answered from the replay cache
        assert await svc.verify(str(sid), first.encode(svc.verifier.vocab_size),
                                None) == first_out
        assert svc.sessions.get(str(sid)).next_seq == 2
        await svc.stop()

    asyncio.run(main())


def test_sdk_defaults_are_the_benchmarked_policy(svc, tok, close_draft, reference):
    """An app that names no policy drafts as the benchmark's fastest single-request mode
    (depth 8 paced to the round trip for greedy requests, fixed for sampled ones, IPDG,
    blocks sent ahead) and still commits the target's greedy output; proactive="off"
    turns send-ahead off with it."""
    from edge_sdk.control import PacedDepth
    from edge_sdk.defaults import DEFAULT_CONTROLLER, DEFAULT_DEPTH, DEFAULT_PROACTIVE

    c = EdgeClient("http://127.0.0.1:9", None, tok)
    assert (c.depth, c.proactive, c.send_ahead) == (DEFAULT_DEPTH, DEFAULT_PROACTIVE, True)
    assert (DEFAULT_DEPTH, DEFAULT_PROACTIVE, DEFAULT_CONTROLLER) == (8, "ipdg", "paced")
    greedy, key = c._request_controller(None, None, greedy=True)
    assert isinstance(greedy, PacedDepth) and greedy.depth == 8 and key == "paced"
    sampled, key = c._request_controller(None, None, greedy=False)
    assert isinstance(sampled, FixedDepth) and sampled.depth == 8 and key is None
    assert EdgeClient("http://127.0.0.1:9", None, tok, proactive="off").send_ahead is False

    async def main():
        async with EdgeClient("inproc://", TorchDrafter(close_draft), tok, chat=False,
                              transport=SlowTransport(svc(), 0.03)) as client:
            return await client.generate(prompt_ids=PROMPT, max_new_tokens=40)
    out = asyncio.run(main())
    assert out.token_ids == reference
    m = out.metrics
    assert max(m["depth_hist"]) == DEFAULT_DEPTH      # the default depth was drafted
    assert m["proactive_rounds"] > 0 and m["ahead_blocks"] > 0   # blocks were sent ahead


def test_send_ahead_needs_proactive(tok):
    with pytest.raises(ValueError, match="send_ahead"):
        EdgeClient("http://127.0.0.1:9", None, tok, proactive="off", send_ahead=True)


def test_on_round_hook_gets_one_record_per_round(svc, tok, close_draft):
    """The round records reach the caller through ``on_round``; the SDK keeps none."""
    out = generate(svc, TorchDrafter(close_draft), tok, n=20, proactive="ipdg")
    trace = out.metrics.pop("round_trace")
    assert "round_trace" not in out.metrics
    assert [r["round"] for r in trace] == list(range(out.metrics["rounds"]))
    assert [r["accepted"] for r in trace] == out.metrics["accepted_hist"]
    assert all(0 <= r["t_send"] <= r["t_response"] for r in trace)


class Recording(FixedDepth):
    """A fixed-depth controller that keeps the round records it is given."""

    def __init__(self, depth: int = 4):
        super().__init__(depth)
        self.records = []

    def update(self, rnd):
        self.records.append(rnd)


class SlowCreate(InProcessTransport):
    """The session create is answered ``hold_s`` late (a target prefill)."""

    def __init__(self, svc, hold_s: float):
        super().__init__(svc)
        self.hold_s = hold_s

    async def request(self, method, path, body=b"", content_type=""):
        out = await super().request(method, path, body)
        if method == "POST" and path.rstrip("/").endswith("/sessions"):
            await asyncio.sleep(self.hold_s)
        return out


def test_first_round_reports_no_round_cycle(svc, tok, close_draft):
    """A request's first round has no previous verdict: its span from the request start
    holds the session create (here held 0.3 s) and the draft's prefill, which are no
    round cost, so its record carries ``round_s=None`` (a controller pricing it in, as
    CAAC's edge overhead did, went to depth 8 at the start of every request); every
    later round reports its cycle, each well under the create's hold."""
    ctrl = Recording(4)

    async def main():
        async with EdgeClient("inproc://", TorchDrafter(close_draft), tok, chat=False,
                              transport=SlowCreate(svc(), 0.3)) as c:
            for _ in range(2):
                await c.generate(prompt_ids=PROMPT, max_new_tokens=12, controller=ctrl)
    asyncio.run(main())
    recs = ctrl.records
    firsts = [i for i, r in enumerate(recs) if r.round_s is None]
    assert firsts[0] == 0 and len(firsts) == 2           # one per request
    assert all(r.resp_s is not None for r in recs)
    assert all(0 < r.round_s < 0.3 for r in recs if r.round_s is not None)


class DraftedSignal(SlowDrafter):
    """A slow drafter that signals (a threading.Event) when it has drafted a block."""

    def __init__(self, model, step_s: float):
        super().__init__(model, step_s)
        self.drafted = threading.Event()

    def propose(self, *args, **kw):
        out = super().propose(*args, **kw)
        self.drafted.set()
        return out

    def fork(self):
        return DraftedSignal(self.kv.model, self.step_s)


class HeldCreate(InProcessTransport):
    """Holds the session create's answer until ``drafter`` has drafted a block (at most
    ``hold_s``, a target prefill on a long prompt), and records whether it had."""

    def __init__(self, svc, drafter: DraftedSignal, hold_s: float = 5.0):
        super().__init__(svc)
        self.drafter, self.hold_s, self.drafted_before_answer = drafter, hold_s, None

    async def request(self, method, path, body=b"", content_type=""):
        out = await super().request(method, path, body)
        if method == "POST" and path.rstrip("/").endswith("/sessions"):
            ev = self.drafter.drafted
            await asyncio.get_running_loop().run_in_executor(None, ev.wait, self.hold_s)
            self.drafted_before_answer = ev.is_set()
        return out


@pytest.mark.parametrize("max_block", [16, 2])
def test_first_block_is_drafted_during_the_create(target, tok, close_draft, reference,
                                                  max_block):
    """Round 0's block is drafted while the cloud answers the create (the create's
    answer waits for it; drafting only after the answer would leave it waiting the
    whole hold); a server with a smaller max block gets the block cut to it. Output
    unchanged (greedy identity)."""
    depth = 6
    drafter = DraftedSignal(close_draft, 0.01)
    tr = HeldCreate(CloudService(target, tok, max_block=max_block), drafter)
    seen: list[int] = []

    async def main():
        async with EdgeClient("inproc://", drafter, tok, chat=False, transport=tr,
                              depth=depth) as c:
            return await c.generate(prompt_ids=PROMPT, max_new_tokens=40,
                                    on_round=lambda r: seen.append(r["depth"]))
    out = asyncio.run(main())
    assert out.token_ids == reference
    assert tr.drafted_before_answer is True
    assert seen[0] == min(depth, max_block) and max(seen) <= max_block


class BrokenDrafter(TorchDrafter):
    """A drafter whose prefill fails (a broken draft runtime)."""

    def sync(self, context):
        raise RuntimeError("draft runtime broke")


def test_a_refused_create_is_the_error_raised_not_the_drafts(target, tok, close_draft):
    """The first block is drafted during the create; when both fail, the caller gets
    the create's answer (here 400 naming prompt_ids: too long for the target's
    context), not the draft's exception."""
    from edge_sdk.transport import RemoteError

    async def main():
        async with EdgeClient("inproc://", BrokenDrafter(close_draft), tok, chat=False,
                              transport=InProcessTransport(CloudService(target, tok))) as c:
            await c.generate(prompt_ids=[5] * 400, max_new_tokens=4)
    with pytest.raises(RemoteError) as e:
        asyncio.run(main())
    assert e.value.status == 400 and "prompt_ids" in str(e.value)


def test_top_ids_is_a_stable_descending_sorts_head():
    """``top_ids`` (the proactive roots' guesses) equals the first b of a stable
    descending argsort, ties to the lower id, -inf entries included, on random logits
    with many ties and on a vocabulary-sized vector."""
    from edge_sdk.proactive import top_ids

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        x = torch.randint(-3, 4, (40,), generator=g).double()
        x[torch.rand(40, generator=g) < 0.2] = float("-inf")
        for b in (1, 2, 3, 7, 40, 50):
            want = torch.argsort(-x, stable=True)[:b]
            assert torch.equal(top_ids(x, b), want), (trial, b)
    x = torch.randn(151_936, generator=g, dtype=torch.float64)
    x[[5, 99, 151_000]] = x.max() + 1.0                       # a three-way tie on top
    assert top_ids(x, 4)[:3].tolist() == [5, 99, 151_000]
    assert torch.equal(top_ids(x, 4), torch.argsort(-x, stable=True)[:4])
