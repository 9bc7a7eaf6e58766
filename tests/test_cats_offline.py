"""Cloud loss with ``on_cloud_loss="local"``: the server is killed
mid-generation, the device continues exactly with its own budgeted copy of the target
(CATS), every token stays verified, and the request hands back to the cloud when it
answers: the greedy output equals the fault-free run, nothing lost or repeated."""

from __future__ import annotations

import dataclasses

import pytest
from safetensors.torch import save_file

from cloud_api.app import create_app
from cloud_api.server import BackgroundServer
from edge_sdk import EdgeClient
from edge_sdk.drafters.torch import TorchDrafter
from edge_sdk.exit_head import untrained_head
from edge_sdk.local_target.budget import plan
from edge_sdk.local_target.load import LocalTarget, sizes_of
from edge_sdk.local_target.runner import OffloadedTarget
from edge_sdk.local_target.session import LocalSession
from edge_sdk.local_target.storage import Storage, StorageProfile
from test_offline import KillingTransport, N, PROMPT, _run


def _local(tmp_path, model, tok) -> LocalSession:
    path = tmp_path / "target.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    store = Storage(path, StorageProfile("slow-flash", 1e6))   # ~37 ms per streamed pass
    p = dataclasses.replace(plan(sizes_of(store, model.config), 10 ** 9, 2e9),
                            resident_layers=1, exit_layer=1, depth=3, gate=0.0)
    # layer 1 streamed, one buffer: with a read-ahead the local steps would hide every
    # read and finish before the cloud is back
    t = OffloadedTarget(store, model.config, 1, prefetch=False)
    return LocalSession(LocalTarget(t, p, tok, untrained_head(t.model, 1)))


def test_local_policy_equals_fault_free_run(tmp_path, target, draft, tok):
    with BackgroundServer(create_app(target, tok)) as srv:
        reference = _run(srv.url, TorchDrafter(draft), tok)[0]
    make = lambda: create_app(target, tok)  # noqa: E731
    box = [BackgroundServer(make()).start()]
    t = KillingTransport(box[0].url, box, make, down_s=0.6)
    local = _local(tmp_path, target, tok)
    try:
        r, events = _run(box[0].url, TorchDrafter(draft), tok, t, on_cloud_loss="local",
                         local_target=local, probe_interval_s=0.2)
    finally:
        box[0].stop()
    assert t.t_kill is not None and t.t_back is not None
    assert [e.token_id for _, e in events] == r.token_ids            # nothing lost/repeated
    assert r.token_ids == reference.token_ids and r.all_verified
    assert r.metrics["local_tokens"] > 0 and r.metrics["unverified_tokens"] == 0
    assert any(t.t_back < ts for ts, _ in events)                     # the cloud again


def test_local_policy_needs_a_local_target(tok):
    with pytest.raises(ValueError, match="local_target"):
        EdgeClient("http://127.0.0.1:1", None, tok, on_cloud_loss="local")


def test_step_continues_any_prefix_exactly(tmp_path, target, tok):
    """step() after arbitrary jumps (a handover from the cloud: a longer prefix; a
    rollback) gives the target's greedy continuation."""
    local = _local(tmp_path, target, tok)
    ref, _ = local.generate(PROMPT, N)
    ids = list(PROMPT)
    while len(ids) - len(PROMPT) < N:
        ids += local.step(ids, N - (len(ids) - len(PROMPT)))
        if len(ids) - len(PROMPT) == 10:
            ids = PROMPT + ref[:20]                          # the cloud went ahead
    assert ids[len(PROMPT):] == ref
    assert local.step(PROMPT + ref[:5], 1) == ref[5:6]       # rolled back
