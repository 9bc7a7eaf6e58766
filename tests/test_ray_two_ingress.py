"""Two ``specrelay serve --ray-address`` ingress *processes* on one Ray cluster: they
share the verifier replicas (one Ray Serve application: a session created through A
is read through B), the replay (nonce) cache (a signed request accepted by A is
refused when replayed to B) and the rate-limit windows (a key's rpm spans both). A
Serve application found by name that serves another model is refused in one line,
never redeployed. A tiny random model saved to a folder (the ``--model DIR`` a user
would pass); the cluster is this test process's, so it ends with the module."""

from __future__ import annotations

import asyncio
import functools
import json

import pytest

ray = pytest.importorskip("ray", reason="needs the [ray] extra: pip install -e \".[ray]\"")

import conftest  # noqa: E402
from cloud_api.keys import SQLiteKeyStore  # noqa: E402
from cloud_api.replicas import cluster  # noqa: E402
from edge_sdk.protocol import wire  # noqa: E402
from edge_sdk.protocol.signing import Signer  # noqa: E402
from serve_process import ServeProcess, save_tiny  # noqa: E402

def pair(seed: int):
    """A replica target factory (the workers import it from this module)."""
    return conftest.tiny_model(seed=seed), conftest.tiny_tokenizer()


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster other processes can join: its GCS address. Replica workers
    import the repository (and this module) first."""
    with conftest.worker_pythonpath():
        cluster.connect(num_cpus=4)
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            cluster.shutdown()


@pytest.fixture(scope="module")
def two_ingress(ray_cluster, tmp_path_factory):
    """Ingress processes A and B over 2 shared replicas, with a key store holding a
    roomy key and a key of 4 requests per minute."""
    tmp = tmp_path_factory.mktemp("two-ingress")
    model = save_tiny(tmp / "tiny")
    db = str(tmp / "keys.sqlite3")
    store = SQLiteKeyStore(db)
    _, raw = store.create("robot", scopes=("verify",), rpm=100_000, tpm=10_000_000)
    _, tight = store.create("tight", scopes=("verify",), rpm=4, tpm=10_000_000)
    args = ["--model", model, "--dtype", "float32", "--threads", "1", "--replicas", "2",
            "--ray-address", ray_cluster, "--db", db]
    procs = [ServeProcess(tmp, n, args) for n in ("a", "b")]
    try:
        health = [p.wait_healthy() for p in procs]
        yield {"a": procs[0], "b": procs[1], "health": health,
               "signer": Signer.from_api_key(raw), "tight": Signer.from_api_key(tight)}
    finally:
        for p in procs:
            p.stop()


def test_two_ingress_processes_share_replicas_replay_cache_and_rate_limits(two_ingress):
    a, b = two_ingress["a"], two_ingress["b"]
    assert a.proc.pid != b.proc.pid
    assert all(h["replicas"] == 2 for h in two_ingress["health"])
    assert "2 verifier replicas on Ray cluster" in a.log.read_text()
    signer = two_ingress["signer"]
    path = "/v1/sessions"
    body = wire.pack({"prompt_ids": [3, 4], "max_new_tokens": 4})
    headers = {"content-type": "application/x-msgpack",
               **signer.headers("POST", path, body)}
    ra, rb = conftest.RawHTTP(a.url, None), conftest.RawHTTP(b.url, None)
    try:
        st, data = ra("POST", path, body, headers=headers)
        assert st == 201, data
        sid = wire.unpack(data)["session_id"]
        st, data = rb("POST", path, body, headers=headers)        # the same bytes
        err = json.loads(data)["error"]
        assert st == 401 and err["code"] == "replayed_nonce", data
        assert conftest.RawHTTP(b.url, signer).state(sid)["session_id"] == sid
        ta, tb = conftest.RawHTTP(a.url, two_ingress["tight"]), conftest.RawHTTP(
            b.url, two_ingress["tight"])
        got = [(ta if i % 2 else tb)("GET", "/v1/sessions/1")[0] for i in range(6)]
        assert got == [404] * 4 + [429] * 2, got                 # one window of 4
        ta.close()
        tb.close()
    finally:
        ra.close()
        rb.close()


def test_replicas_found_by_name_serving_another_model_are_refused(ray_cluster):
    """An application found by name is reused only for what it serves: the same
    factory with other arguments (other weights) is refused naming the spec, another
    model spec naming the model (neither redeploys it: the same replica answers
    after); replicas that loaded different weights are refused naming the weights."""
    def start(target, n):
        return cluster.start_replicas(target, n, num_cpus=0, app="idcheck")

    client, info = start(functools.partial(pair, 0), 1)
    try:
        assert len(info["weights_sha"]) == 16 and info["model"].endswith(".pair")
        first = asyncio.run(client.live_slots())
        with pytest.raises(cluster.ReplicaMismatch, match="spec_sha"):
            start(functools.partial(pair, 1), 2)
        with pytest.raises(cluster.ReplicaMismatch, match="serves model") as e:
            start("smollm2-135m", 1)
        assert "\n" not in str(e.value)
        again, same = start(functools.partial(pair, 0), 1)
        assert same == info and asyncio.run(again.live_slots()) == first  # the same one
        other = {**info, "slot": 1, "weights_sha": "0" * 16}
        why = cluster.mismatch([{**info, "slot": 0}, other], {"model": info["model"]})
        assert "weights_sha" in why and "\n" not in why
    finally:
        cluster.stop_replicas("idcheck")
