"""Wire decoders and the signed-request parser under fuzzing.

A short coverage-guided run of every atheris target (the long runs are
``python -m fuzz all --runs 1000000``), checks that the harness itself catches what it
looks for, and a property test: a message decoded from its encoding re-encodes to the
same bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.protocol import wire
from fuzz import targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", list(targets.TARGETS))
def test_short_fuzz_run_finds_nothing(name, tmp_path):
    runs = 3000 if name == "auth_request" else 20000
    p = subprocess.run([sys.executable, "-m", "fuzz", name, f"-runs={runs}",
                        # no RSS limit here: a child forked from the large pytest
                        # process inherits its peak RSS (ru_maxrss survives exec), which
                        # libFuzzer would read as its own; `python -m fuzz all` keeps one
                        "-rss_limit_mb=0", f"-artifact_prefix={tmp_path}/"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"Done {runs} runs" in p.stderr
    assert "cov:" in p.stderr                       # the code under test is instrumented


def test_seeds_are_accepted_by_their_decoders():
    """The starting corpus is made of valid messages (else the fuzzer starts blind)."""
    v = targets.VOCABS[2]
    for seed in targets.seeds("verify_request"):
        vocab, body = targets._vocab(seed)
        wire.VerifyRequest.decode(body, vocab, targets.MAX_BLOCK)
    for seed in targets.seeds("verify_response"):
        wire.VerifyResponse.decode(seed)
    for seed in targets.seeds("correction_response"):
        wire.CorrectionResponse.decode(seed)
    for seed in targets.seeds("session_request"):
        wire.decode_session_request(wire.unpack(seed[1:]), v, 4096)


def test_auth_harness_catches_a_permissive_parser():
    """With a middleware that lets everything through, the forgery property fires."""
    h = targets._AuthHarness()

    async def permissive(request, handler):
        return await handler(request)

    h.middleware = permissive
    rng = np.random.default_rng(0)
    with pytest.raises(targets.Finding, match="forged request reached"):
        for _ in range(200):
            h.run(rng.bytes(96))


def test_decoder_harness_catches_a_lossy_round_trip(monkeypatch):
    seed = targets.seeds("verify_response")[0]
    real = wire.VerifyResponse.encode
    monkeypatch.setattr(wire.VerifyResponse, "encode",
                        lambda self: real(self)[:-1] + b"\x90")   # drops the near ties
    with pytest.raises(targets.Finding):
        targets.verify_response(seed)


# --------------------------------------------------------------------- round trips

ids = st.lists(st.integers(0, 151_935), min_size=0, max_size=8)
probs = st.floats(0.0, 1.0, allow_nan=False, exclude_min=True)


@settings(max_examples=300, deadline=None)
@given(ids, st.integers(0, 2**40), st.integers(0, 2**40), st.integers(1, 2**40),
       st.integers(0, 65535), st.one_of(st.none(), st.integers(0, 151_935)),
       st.booleans(), st.one_of(st.none(), st.integers(0, 151_935)))
def test_verify_request_round_trips_byte_identical(toks, sid, seq, base, cfg, pend, with_q,
                                                   expect):
    if pend is not None:
        expect = None
    q = np.linspace(0.1, 1.0, len(toks)) if with_q else None
    m = wire.VerifyRequest(sid, seq, base, cfg, pend, np.array(toks, dtype=np.int64), q,
                           None, expect)
    b = m.encode(151_936)
    d = wire.VerifyRequest.decode(b, 151_936, 8)
    assert d.encode(151_936) == b
    assert targets._same(d, wire.VerifyRequest.decode(d.encode(151_936), 151_936, 8))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**40), st.integers(0, 8), st.booleans(),
       st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=6),
       st.floats(0, 1e6, allow_nan=False), st.lists(st.integers(0, 4096), max_size=8))
def test_verify_response_round_trips_byte_identical(seq, acc, bonus, cids, t, ties):
    corr = None if bonus else wire.Correction(
        len(cids) % 2 == 0, np.array(cids), np.full(len(cids), 1 / len(cids)),
        np.array(cids[:2]), np.full(len(cids[:2]), 0.5))
    m = wire.VerifyResponse(seq, acc, cids[0] if bonus else None, corr, 5, float(t),
                            tuple(ties))
    b = m.encode()
    assert wire.VerifyResponse.decode(b).encode() == b


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**40), st.booleans(), st.one_of(st.none(), st.integers(1, 151_936)),
       st.lists(probs, min_size=1, max_size=16))
def test_correction_messages_round_trip_byte_identical(seq, complete, k, p):
    b = wire.CorrectionRequest(seq, k).encode()
    assert wire.CorrectionRequest.decode(b, 151_936).encode() == b
    r = wire.CorrectionResponse(seq, complete, np.arange(len(p)), np.array(p))
    b = r.encode()
    assert wire.CorrectionResponse.decode(b).encode() == b
