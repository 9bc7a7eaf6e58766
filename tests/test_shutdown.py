"""Graceful shutdown: a block in flight when the server stops is still answered."""

import threading
import time

import numpy as np
import requests

from cloud_api.app import create_app
from cloud_api.server import BackgroundServer
from edge_sdk.protocol import wire
from tests.conftest import tiny_model


def test_in_flight_block_finishes_during_shutdown(tok):
    model = tiny_model(seed=0)
    slow = {"on": False}

    def hook(module, args, kwargs):
        if slow["on"]:
            time.sleep(0.8)          # a slow target pass

    model.register_forward_pre_hook(hook, with_kwargs=True)
    srv = BackgroundServer(create_app(model, tok)).start()
    http = requests.Session()
    r = http.post(srv.url + "/v1/sessions", data=wire.pack({"prompt_ids": [4, 5, 6]}),
                  headers={"content-type": "application/x-msgpack"})
    sid = int(wire.unpack(r.content)["session_id"])
    body = wire.VerifyRequest(sid, 0, 3, wire.unpack(r.content)["config_id"],
                              None, np.array([7, 8]), None, None).encode(64)
    result = {}

    def send():
        resp = http.post(f"{srv.url}/v1/sessions/{sid}/verify", data=body)
        result["status"], result["body"] = resp.status_code, resp.content

    slow["on"] = True
    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.3)                   # the block is inside the target pass now
    srv.stop()                        # graceful: waits for the in-flight handler
    t.join(10)
    assert result.get("status") == 200
    assert wire.VerifyResponse.decode(result["body"]).block_seq == 0
