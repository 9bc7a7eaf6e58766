"""Fake serving engines answering in SGLang's and vLLM's documented scoring formats,
scored by a local model (the scoring backend's tests; no GPU, no engine install)."""

from __future__ import annotations

import torch
from aiohttp import web

__all__ = ["fake_sglang", "fake_vllm"]


def fake_sglang(model) -> web.Application:
    """``POST /generate`` in SGLang's input-logprob format, scored by ``model``."""
    async def generate(request):
        body = await request.json()
        out = []
        for ids, start in zip(body["input_ids"], body["logprob_start_len"]):
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
            top = torch.topk(lp, body["top_logprobs_num"], -1)
            rows = [None] * len(ids)       # rows[i]: the distribution predicting ids[i]
            for i in range(1, len(ids)):
                rows[i] = [[float(v), int(t), None] for v, t in
                           zip(top.values[i - 1], top.indices[i - 1])]
            out.append({"text": "", "meta_info": {"input_top_logprobs": rows[start:]}})
        return web.json_response(out)

    app = web.Application()
    app.router.add_post("/generate", generate)
    return app


def fake_vllm(model) -> web.Application:
    """``POST /v1/completions`` with ``prompt_logprobs`` in vLLM's format."""
    async def completions(request):
        body = await request.json()
        choices = []
        for i, ids in enumerate(body["prompt"]):
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
            top = torch.topk(lp, body["prompt_logprobs"], -1)
            rows = [None] + [
                {str(int(t)): {"logprob": float(v), "rank": r + 1}
                 for r, (v, t) in enumerate(zip(top.values[j - 1], top.indices[j - 1]))}
                | {str(ids[j]): {"logprob": float(lp[j - 1, ids[j]]), "rank": 99}}
                for j in range(1, len(ids))]
            choices.append({"index": i, "text": "", "prompt_logprobs": rows})
        return web.json_response({"choices": choices})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app
