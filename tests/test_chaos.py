"""The link-fault matrix (``bench.chaos``) on the suite's tiny random pair: single HTTP
requests dropped, duplicated, reordered, delayed past the client's timeout, cut
mid-body, and partitions; greedy and seeded sampling, stop-and-wait and IPDG with
blocks sent ahead (and a pipeline of 8); on verify, create and correction requests
(sampling only, a client whose every rejection needs one). Every faulted run must equal
the fault-free run, lose and duplicate nothing, and cost no extra target pass (a
replayed block is answered from the server's replay cache). The server is the signed
in-process API."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from click.testing import CliRunner

from bench.chaos.faults import CORRECTION_CLIENT, Fault, FaultPlan, fault_matrix
from bench.chaos.matrix import ChaosSettings, Server, _client, _one, _Job, references, run_fault
from bench.chaos.proxy import FaultProxy
from bench.chaos.run import select
from bench.chaos.score import ROW_KEYS, Row, RunOutcome, score_tokens
from cloud_api.context import SERVICE
from cloud_api.local import local_server
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.protocol.sampling import SamplingConfig

TIMEOUT_S = 1.0
PROMPTS = [[4, 5, 6], [9, 3, 7, 2], [11, 12], [20, 21, 22], [30, 2], [5, 5, 5], [40], [7, 8]]


def _settings(**kw) -> ChaosSettings:
    base = dict(prompts=PROMPTS[:1], pipeline_prompts=PROMPTS,
                samplings={"greedy": SamplingConfig(),
                           "sampled": SamplingConfig(temperature=0.8)},
                max_new_tokens=24, depth=3, seed=7, timeout_s=TIMEOUT_S, retries=2,
                offline_timeout_s=20.0, modes=("stop-and-wait", "ipdg+ahead"))
    return ChaosSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def live(target, tok):
    with local_server(target, tok, max_batch=8) as ls:
        svc = ls.app[SERVICE]
        svc.eos = []                     # every request runs to its length cap
        yield Server(ls.url, ls.signer, lambda: svc.verifier.passes), svc


@pytest.fixture(scope="module")
def srv(live):
    return live[0]


@pytest.fixture(scope="module")
def drafter(draft):
    return TorchDrafter(draft)


@pytest.fixture(scope="module")
def refs(srv, drafter, tok):
    return references(srv, drafter, tok, _settings(modes=("stop-and-wait", "ipdg+ahead",
                                                          "pipeline-8")))


def _clean(row: Row) -> None:
    assert row.undocumented == []
    assert (row.identical, row.lost, row.duplicated, row.errors) == (row.runs, 0, 0, 0), row
    assert row.extra_passes == 0                     # replayed blocks: no second pass
    assert row.injected >= 1


@pytest.mark.parametrize("kind", ["drop-request", "drop-response", "duplicate", "reorder",
                                  "delay-request", "delay-response", "reset-request",
                                  "reset-response"])
def test_verify_fault_leaves_the_output_identical(srv, drafter, tok, refs, kind):
    late = kind.startswith("delay")                  # one delay per run: each costs 1.5 s
    f = Fault(kind, kind, at=(2,) if late else (2, 4), seconds=TIMEOUT_S + 0.5 if late else 0)
    row = run_fault(srv, drafter, tok, _settings(), f, refs)
    assert row.runs == 4                             # 2 samplings x 2 modes x 1 prompt
    _clean(row)


def test_a_request_cut_mid_body_is_no_server_error(srv, drafter, tok, refs, caplog):
    s = _settings(modes=("stop-and-wait",), samplings={"greedy": SamplingConfig()})
    with caplog.at_level(logging.ERROR, logger="aiohttp.server"):
        row = run_fault(srv, drafter, tok, s, Fault("r", "reset-request", at=(2, 3)), refs)
    _clean(row)
    assert not [r for r in caplog.records if "Error handling request" in r.getMessage()]


@pytest.mark.parametrize("kind", ["drop-response", "duplicate"])
def test_create_fault_leaves_the_output_identical(srv, drafter, tok, refs, kind):
    row = run_fault(srv, drafter, tok, _settings(), Fault(kind, kind, "create", (1,)), refs)
    _clean(row)


def test_a_create_whose_answer_is_lost_leaves_no_second_session(live, drafter, tok, refs):
    srv, svc = live
    n0 = len(svc.sessions)
    s = _settings(modes=("stop-and-wait",), samplings={"greedy": SamplingConfig()})
    row = run_fault(srv, drafter, tok, s, Fault("d", "drop-response", "create", (1,)), refs)
    _clean(row)
    assert len(svc.sessions) == n0       # the retry got the same session, deleted at the end


def test_a_create_retried_past_the_transports_retries_is_one_session(live, drafter, tok,
                                                                     refs):
    """The answers to the first three creates lost, one more than the transport's two
    retries: the client's own retry of the create (waiting out a lost cloud) carries
    the same request id, so the cloud makes one session (one prefill of the prompt),
    not a second that lingers, and the output is the fault-free one."""
    srv, svc = live
    n0 = len(svc.sessions)
    s = _settings(modes=("stop-and-wait",), samplings={"greedy": SamplingConfig()})
    row = run_fault(srv, drafter, tok, s,
                    Fault("d3", "drop-response", "create", (1, 2, 3)), refs)
    _clean(row)
    assert row.injected == 3 and len(svc.sessions) == n0


def test_create_with_a_request_id_is_idempotent(live):
    from edge_sdk.protocol import wire
    from tests.conftest import RawHTTP

    srv, svc = live
    http = RawHTTP(srv.url, srv.signer)
    try:
        n0 = len(svc.sessions)
        a = http.create(prompt_ids=[4, 5, 6], request_id="r-1")
        b = http.create(prompt_ids=[4, 5, 6], request_id="r-1")
        assert a["session_id"] == b["session_id"] and len(svc.sessions) == n0 + 1
        st, data = http("POST", "/v1/sessions", wire.pack({"prompt_ids": [4, 5],
                                                           "request_id": "r-1"}))
        assert st == 409 and b"request_id_reused" in data
        st, _ = http("POST", "/v1/sessions", wire.pack({"prompt_ids": [4], "request_id": 5}))
        assert st == 400
    finally:
        http.close()


SAMPLED = SamplingConfig(temperature=0.8)


@pytest.mark.parametrize("kind", ["drop-request", "drop-response", "duplicate", "reorder",
                                  "delay-request", "delay-response", "reset-request",
                                  "reset-response"])
def test_correction_fault_leaves_the_output_identical(srv, drafter, tok, refs, kind):
    late = kind.startswith("delay")
    f = Fault(kind, kind, "correction", at=(1,) if late else (1, 3),
              seconds=TIMEOUT_S + 0.5 if late else 0)
    row = run_fault(srv, drafter, tok, _settings(), f, refs)
    assert row.runs == 2                             # sampled only x 2 modes x 1 prompt
    _clean(row)
    assert row.injected == (2 if late else 4) and row.seen > row.injected   # hits counted
    assert row.target == "correction" and not row.never_fired


def test_correction_retries_used_up_redo_the_round_with_the_same_draw(srv, drafter, tok):
    """The first correction request dropped three times (one more than the transport's
    2 retries): the round fails after its verdict and is redone; the resent block is
    answered from the replay cache and the correction token redrawn from the same
    seeded generator: identical output, no extra target pass."""
    clean = _through_proxy(srv, drafter, tok, Fault("n", "none"), "stop-and-wait", SAMPLED,
                           **CORRECTION_CLIENT)
    p0 = srv.passes()
    toks, err, stats, seen = _through_proxy(
        srv, drafter, tok, Fault("x3", "drop-request", "correction", (1, 2, 3)),
        "stop-and-wait", SAMPLED, **CORRECTION_CLIENT)
    assert err is None and clean[1] is None and toks == clean[0]
    assert stats.fired == 3 and seen["correction"] == clean[3]["correction"] + 3
    assert seen["verify"] == clean[3]["verify"] + 1         # the block was resent
    assert srv.passes() - p0 == clean[3]["verify"]          # ... and not verified again


def test_a_duplicated_correction_request_is_refused_as_a_replay(srv, drafter, tok):
    toks, err, stats, seen = _through_proxy(
        srv, drafter, tok, Fault("d", "duplicate", "correction", (1,)), "ipdg+ahead",
        SAMPLED, **CORRECTION_CLIENT)
    clean = _through_proxy(srv, drafter, tok, Fault("n", "none"), "ipdg+ahead", SAMPLED,
                           **CORRECTION_CLIENT)
    assert err is None and toks == clean[0] and stats.duplicate_statuses == [401]


def test_pipeline_of_8_rides_out_dropped_correction_answers(srv, drafter, tok, refs):
    s = _settings(modes=("pipeline-8",))
    row = run_fault(srv, drafter, tok, s, Fault("c", "drop-response", "correction", (2, 9)),
                    refs)
    assert row.runs == 8 and row.injected == 2
    assert (row.identical, row.lost, row.duplicated, row.undocumented) == (8, 0, 0, [])


def test_correction_rows_run_sampling_only(srv, drafter, tok, refs):
    s = _settings(samplings={"greedy": SamplingConfig()})
    row = run_fault(srv, drafter, tok, s, Fault("c", "drop-request", "correction"), refs)
    assert row.runs == 0 and "greedy" in row.note and not row.never_fired
    never = Row("v", runs=2, expect_hits=True)
    assert never.never_fired


def test_a_repeated_correction_request_gets_the_same_answer(live):
    """A correction request is a read of the pending correction: asked twice (fresh
    signatures) it is answered with the same bytes and the session does not change."""
    from edge_sdk.protocol import wire
    from tests.conftest import RawHTTP

    srv, svc = live
    http = RawHTTP(srv.url, srv.signer)
    try:
        info = http.create(prompt_ids=[4, 5, 6], sampling={"temperature": 0.8}, seed=3,
                           support_k=1, n_proposals=0)
        sid, path = info["session_id"], f"/v1/sessions/{info['session_id']}"
        block = wire.VerifyRequest(int(sid), 0, 3, info["config_id"], None,
                                   [1, 2, 3, 7], [1.0] * 4, None, 6)
        st, data = http("POST", path + "/verify", block.encode(64))
        assert st == 200 and wire.VerifyResponse.decode(data).correction is not None
        before = http.state(sid)
        for k in (None, 8):
            body = wire.CorrectionRequest(0, k).encode()
            answers = [http("POST", path + "/correction", body) for _ in range(3)]
            assert answers[0][0] == 200 and answers.count(answers[0]) == 3
        assert http.state(sid) == before and before["awaiting_correction"]
    finally:
        http.cleanup()
        http.close()


def test_select_keeps_the_named_rows():
    rows = fault_matrix(3.0, quick=False)
    corr = select(rows, ["correction"])
    assert {f.target for f in corr} == {"correction"} and len(corr) == 10
    assert {"drop-request", "drop-response", "duplicate", "delay-request", "delay-response",
            "reset-request", "reset-response"} <= {f.kind for f in corr}
    assert select(rows, []) == rows
    with pytest.raises(ValueError):
        select(rows, ["no such row"])


def test_pipeline_of_8_rides_out_a_dropped_response(srv, drafter, tok, refs):
    s = _settings(modes=("pipeline-8",), samplings={"sampled": SamplingConfig(temperature=0.8)})
    row = run_fault(srv, drafter, tok, s, Fault("drop-response", "drop-response", at=(3, 9)),
                    refs)
    assert row.runs == 8
    assert (row.identical, row.lost, row.duplicated, row.undocumented) == (8, 0, 0, [])


def test_short_partition_is_ridden_out(srv, drafter, tok, refs):
    s = _settings(modes=("ipdg+ahead",), samplings={"greedy": SamplingConfig()})
    row = run_fault(srv, drafter, tok, s, Fault("p", "partition", at=(2,), seconds=1.5), refs)
    _clean(row)


def test_partition_past_the_offline_timeout_fails_with_cloud_unreachable(srv, drafter,
                                                                          tok, refs):
    s = _settings(modes=("stop-and-wait",), samplings={"greedy": SamplingConfig()},
                  retries=0, timeout_s=0.3)
    f = Fault("p", "partition", at=(2,), seconds=30.0, expect_error=True,
              offline_timeout_s=0.5)
    row = run_fault(srv, drafter, tok, s, f, refs)
    assert (row.runs, row.errors, row.lost, row.duplicated, row.undocumented) == (1, 1, 0, 0,
                                                                                  [])


def _through_proxy(srv, drafter, tok, fault, mode, sampling=None, **client_kw):
    """One request (greedy unless ``sampling``) through a proxy with ``fault``;
    (token ids, error, stats, the plan's requests seen per target)."""
    s = _settings(client_kw=client_kw)

    async def main():
        async with FaultProxy(srv.url, fault) as p:
            async with _client(p.url, srv, drafter, tok, s, mode) as c:
                toks, err = await _one(c, _Job(PROMPTS[0], 7), sampling or SamplingConfig(),
                                       24)
        return toks, err, p.stats, dict(p.plan.seen)

    return asyncio.run(main())


def test_reorder_lets_the_block_sent_ahead_overtake(srv, drafter, tok, refs):
    toks, err, stats, _ = _through_proxy(srv, drafter, tok,
                                         Fault("r", "reorder", at=(2, 4, 6)), "ipdg+ahead")
    assert err is None and toks == refs["greedy", "ipdg+ahead"][0][0]
    assert stats.fired == 3 and stats.reordered >= 1     # a later block went first


def test_a_duplicate_of_a_signed_request_is_refused_as_a_replay(srv, drafter, tok, refs):
    toks, err, stats, _ = _through_proxy(srv, drafter, tok,
                                         Fault("d", "duplicate", at=(2,)), "stop-and-wait")
    assert err is None and toks == refs["greedy", "stop-and-wait"][0][0]
    assert stats.duplicate_statuses == [401]


def test_plan_counts_matching_requests_only():
    plan = FaultPlan(Fault("x", "drop-request", at=(2,)))
    assert plan.pick("POST", "/v1/sessions") is None                 # create: not a target
    assert plan.pick("POST", "/v1/sessions/1/verify") is None        # 1st verify
    assert plan.pick("DELETE", "/v1/sessions/1") is None
    assert plan.pick("POST", "/v1/sessions/1/verify").kind == "drop-request"
    assert plan.pick("POST", "/v1/sessions/1/verify") is None and plan.fired == 1
    plan = FaultPlan(Fault("c", "drop-response", "correction", at=(1,)))
    assert plan.pick("POST", "/v1/sessions/1/verify") is None
    assert plan.pick("POST", "/v1/sessions/1/correction").kind == "drop-response"
    assert plan.pick("POST", "/v1/sessions/1/correction") is None
    assert dict(plan.seen) == {"verify": 1, "correction": 2} and plan.fired == 1


def test_scores():
    ref = [1, 2, 3, 4, 5, 6]
    assert score_tokens(ref, ref) == (0, 0)
    assert score_tokens(ref, [1, 2, 3]) == (3, 0)                    # cut short, no error
    assert score_tokens(ref, [1, 2, 3], failed=True) == (0, 0)       # documented failure
    assert score_tokens(ref, [1, 2, 3, 4, 3, 4, 5, 6]) == (0, 2)     # a repeated block
    assert score_tokens(ref, [1, 2, 5, 6]) == (2, 0)                 # a lost block
    assert score_tokens(ref, ref + [7]) == (0, 1)
    row = Row("f")
    row.add(RunOutcome([1, 2], RuntimeError("boom"), [1, 2]))
    assert row.undocumented == ["RuntimeError: boom"] and row.identical == row.errors == 0
    assert list(row.as_dict()) == list(ROW_KEYS)


def test_cli_writes_the_table_and_chaos_json(monkeypatch, tmp_path, target, draft, tok):
    """``specrelay bench --chaos --quick`` end to end on the tiny pair (two rows)."""
    import bench.chaos.run as R
    from bench.cli import bench

    monkeypatch.setattr(R, "_load", lambda t, d, dt, log: (target, tok, TorchDrafter(draft),
                                                           "tiny-draft", "float32"))
    monkeypatch.setattr(R, "_prompts", lambda tok, n, seed, length=64: PROMPTS[:n])
    monkeypatch.setattr(R, "fault_matrix", lambda timeout_s, quick, at: [
        Fault("none", "none"), Fault("drop-response", "drop-response", at=at),
        Fault("reorder", "reorder", at=at)])
    res = CliRunner().invoke(bench, ["--chaos", "--quick", "--out", str(tmp_path),
                                     "--max-new-tokens", "12", "--sampling", "greedy",
                                     "--chaos-rows", "NONE,drop"])     # not reorder
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "chaos.json").read_text())
    assert [list(r) for r in rows] == [list(ROW_KEYS)] * 2
    assert [r["fault"] for r in rows] == ["none", "drop-response"]
    assert all(r["runs"] == 10 and r["identical"] == 10 for r in rows)   # 1 + 1 + 8
    assert "| drop-response | 10 | 10 | 0 | 0 | 0 |" in (tmp_path / "chaos.md").read_text()
    assert "drop-response" in res.output


def test_cli_refuses_options_that_do_not_apply():
    from bench.cli import bench

    res = CliRunner().invoke(bench, ["--chaos", "--modes", "specrelay"])
    assert res.exit_code == 2 and "does not apply to --chaos" in res.output
    res = CliRunner().invoke(bench, ["--chaos-rows", "correction"])
    assert res.exit_code == 2 and "--chaos-rows applies to --chaos only" in res.output
