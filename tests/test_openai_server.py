"""The OpenAI-compatible edge endpoint, driven by the official ``openai`` client.

Tiny random models (tests/conftest.py) behind a *signed* loopback cloud API; the tiny
tokenizer has no chat template, so chat prompts use the documented fallback formatting
(``edge_sdk.openai_server.chat_prompt_ids``). One real_model test runs SmolLM2 with its
chat template.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from cloud_api.app import create_app  # noqa: E402
from cloud_api.keys import SQLiteKeyStore  # noqa: E402
from cloud_api.server import BackgroundServer  # noqa: E402
from edge_sdk import EdgeClient  # noqa: E402
from edge_sdk.drafters.torch import TorchDrafter  # noqa: E402
from edge_sdk.openai_server import chat_prompt_ids, create_edge_app  # noqa: E402
from edge_sdk.protocol.signing import Signer  # noqa: E402

MODEL = "tiny-test-model"
MSGS = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w3 w4 w5"}]


def _signed_cloud(target, tok):
    store = SQLiteKeyStore(":memory:")
    _, raw = store.create("openai-test", scopes=("verify",), rpm=100_000, tpm=10_000_000)
    return BackgroundServer(create_app(target, tok, key_store=store)), Signer.from_api_key(raw)


@pytest.fixture(scope="module")
def stack(target, draft, tok):
    """(cloud url, signer, edge OpenAI base url) on loopback."""
    cloud, signer = _signed_cloud(target, tok)
    with cloud:
        app = create_edge_app(cloud.url, TorchDrafter(draft), tok, signer=signer, depth=3,
                              model_name=MODEL)
        with BackgroundServer(app) as edge:
            yield cloud.url, signer, edge.url + "/v1"


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=stack[2], api_key="x", max_retries=0, timeout=60)


def _reference(stack, draft, tok, ids, **kw):
    async def go():
        async with EdgeClient(stack[0], TorchDrafter(draft), tok, depth=3,
                              signer=stack[1], chat=False) as c:
            return await c.generate(prompt_ids=ids, **kw)
    return asyncio.run(go())


def _post(url, body, raw=False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_chat_completion_matches_edge_client(stack, oai, draft, tok):
    ids = chat_prompt_ids(tok, MSGS)
    assert tok.chat_template is None      # the fallback formatting is what is tested
    ref = _reference(stack, draft, tok, ids, max_new_tokens=12)
    r = oai.chat.completions.create(model="anything", messages=MSGS, temperature=0,
                                    max_tokens=12)
    assert r.model == MODEL and r.object == "chat.completion"
    ch = r.choices[0]
    assert ch.message.role == "assistant"
    assert ch.message.content == ref.text
    assert ch.finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == len(ids) + len(ref.token_ids)
    assert ch.model_extra["verified"] is True
    assert ch.model_extra["verified_tokens"] == len(ref.token_ids)
    assert "acceptance_rate" in r.model_extra["specrelay"]


def test_chat_streaming_matches_and_usage(stack, oai, draft, tok):
    ids = chat_prompt_ids(tok, MSGS)
    ref = _reference(stack, draft, tok, ids, max_new_tokens=12)
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == ref.text
    assert sum(1 for c in body if c.choices[0].delta.content) >= 2   # really streamed
    assert all(c.choices[0].model_extra["verified"] is True for c in body)
    finishes = [c.choices[0].finish_reason for c in body]
    assert finishes[-1] == ref.finish_reason and not any(finishes[:-1])
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.prompt_tokens == len(ids)
    assert usage.usage.completion_tokens == len(ref.token_ids)


def test_finish_reasons_length_and_stop(stack, oai, draft, tok):
    ids = chat_prompt_ids(tok, MSGS)
    ref = _reference(stack, draft, tok, ids, max_new_tokens=12)
    r = oai.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    words = ref.text.split()
    assert len(words) >= 3, ref.text
    stop = " " + words[2]
    want = ref.text[:ref.text.find(stop)]
    cut = _reference(stack, draft, tok, ids, max_new_tokens=12, stop=[stop])
    for stream in (False, True):
        out = oai.chat.completions.create(model=MODEL, messages=MSGS, temperature=0,
                                          max_tokens=12, stop=stop, stream=stream)
        if stream:
            out = list(out)
            text = "".join(c.choices[0].delta.content or "" for c in out if c.choices)
            fin = out[-1].choices[0].finish_reason
        else:
            text, fin = out.choices[0].message.content, out.choices[0].finish_reason
            assert out.usage.completion_tokens == len(cut.token_ids)
        assert text == want == cut.text and fin == "stop"


def test_completions_text_and_token_prompt(stack, oai, draft, tok):
    prompt = "w9 w10 w11"
    ids = tok.encode(prompt, add_special_tokens=False)
    ref = _reference(stack, draft, tok, ids, max_new_tokens=10)
    r = oai.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=10)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.choices[0].model_extra["verified"] is True
    r2 = oai.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=10)
    assert r2.choices[0].text == ref.text
    chunks = list(oai.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                         max_tokens=10, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_completions_default_max_tokens_is_16(stack, oai):
    r = oai.completions.create(model=MODEL, prompt="w2 w3", temperature=0)
    assert r.usage.completion_tokens <= 16
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 16


def test_sampling_is_seeded(oai):
    kw = dict(model=MODEL, messages=MSGS, temperature=0.9, top_p=0.95, max_tokens=8)
    a = oai.chat.completions.create(seed=5, **kw)
    b = oai.chat.completions.create(seed=5, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.mark.parametrize("kw, param", [
    ({"n": 2}, "n"),
    ({"temperature": 5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"seed": -1}, "seed"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "w3"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
])
def test_bad_chat_requests_are_400(oai, kw, param):
    args = {"model": MODEL, "messages": MSGS, "max_tokens": 4} | kw
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(**args)
    err = ei.value.body
    assert ei.value.status_code == 400
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"]


def test_bad_raw_requests_are_400_openai_shape(stack):
    base = stack[2]
    for url, body, raw in [
        (base + "/chat/completions", b"{not json", True),
        (base + "/chat/completions", [1, 2], False),
        (base + "/completions", {"model": MODEL, "prompt": [10 ** 9]}, False),
        (base + "/completions", {"model": MODEL, "prompt": ["a", "b"]}, False),
        (base + "/completions", {"model": MODEL, "prompt": "w3", "echo": True}, False),
        (base + "/completions", {"model": MODEL, "prompt": "w3", "stream": "yes"}, False),
    ]:
        status, out = _post(url, body, raw)
        assert status == 400, (body, out)
        assert set(out["error"]) == {"message", "type", "param", "code"}


def test_context_overflow_is_400_before_any_drafting(oai, stack):
    """The tiny target's context is 256 positions (the cloud's /healthz says so): a
    longer prompt is refused by the edge itself, naming the OpenAI field, before the
    draft's prefill; a field the cloud refuses is named as the OpenAI request names
    it (max_tokens, not the wire's max_new_tokens)."""
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(model=MODEL, prompt=[5] * 300, max_tokens=4)
    err = ei.value.body
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert "300 tokens" in err["message"] and "256" in err["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": " ".join(["w3"] * 300)}])
    assert ei.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10 ** 7)
    err = ei.value.body
    assert err["param"] == "max_tokens" and "max_new_tokens" not in err["message"], err


def test_models_endpoint(oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]


@pytest.mark.real_model
def test_real_smollm2_chat_via_openai_client():
    """SmolLM2-135M-Instruct target, the default draft, chat template: the OpenAI
    endpoint returns exactly what EdgeClient.generate does (greedy)."""
    from edge_sdk.models import load_model
    from specrelay_cli.options import default_draft

    target, tok = load_model("smollm2-135m")
    dmodel, _ = load_model(default_draft("smollm2-135m"))
    msgs = [{"role": "user", "content": "Name three colors."}]
    ids = chat_prompt_ids(tok, msgs)
    cloud, signer = _signed_cloud(target, tok)
    with cloud:
        app = create_edge_app(cloud.url, TorchDrafter(dmodel), tok, signer=signer,
                              model_name="smollm2")
        with BackgroundServer(app) as edge:
            stack = (cloud.url, signer, edge.url + "/v1")
            client = openai.OpenAI(base_url=stack[2], api_key="x", max_retries=0)
            ref = _reference(stack, dmodel, tok, ids, max_new_tokens=16)
            assert ids == tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
            r = client.chat.completions.create(model="smollm2", messages=msgs,
                                               temperature=0, max_tokens=16)
            assert r.choices[0].message.content == ref.text
            assert r.usage.prompt_tokens == len(ids)
            assert r.usage.completion_tokens == len(ref.token_ids)
            assert r.choices[0].finish_reason == ref.finish_reason
            chunks = list(client.chat.completions.create(
                model="smollm2", messages=msgs, temperature=0, max_tokens=16, stream=True))
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text


def test_health_reports_cloud_reachability_and_key(stack, target, draft, tok):
    import requests

    r = requests.get(stack[2][:-3] + "/health", timeout=30)
    assert r.status_code == 200 and r.json()["cloud"] == {
        "url": stack[0], "reachable": True, "key": "accepted"}
    bad = Signer.from_api_key(sg_format_unknown_key())
    app = create_edge_app(stack[0], TorchDrafter(draft), tok, signer=bad, depth=3)
    with BackgroundServer(app) as edge:
        r = requests.get(edge.url + "/health", timeout=30)
        assert r.status_code == 503 and r.json()["cloud"]["key"].startswith("refused (401")
    dead = create_edge_app("http://127.0.0.1:9", TorchDrafter(draft), tok, depth=3)
    with BackgroundServer(dead) as edge:
        r = requests.get(edge.url + "/health", timeout=30)
        assert r.status_code == 503 and r.json()["cloud"]["reachable"] is False


def sg_format_unknown_key() -> str:
    from edge_sdk.protocol import signing as sg

    return sg.format_api_key("ZZZZZZZZZZZZ", "a" * 32)
