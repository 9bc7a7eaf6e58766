"""Interactive terminal chat on edge-cloud speculative decoding.

The conversation is kept as chat-template turns (system, user, assistant, ...) and every
reply streams token by token as the SDK commits it. Commands: ``/stats`` (metrics of the
last reply), ``/reset`` (forget the conversation), ``/help``, ``/quit``.

Run (starts a local signed server with SmolLM2-135M-Instruct unless ``--url``)::

    python examples/chat_app.py
    python examples/chat_app.py --prompt "Give me a haiku about robots" --stats
    python examples/chat_app.py --url http://127.0.0.1:8000 --api-key sr_live_...

Importable: :class:`ChatSession`, :func:`main`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

if __package__ in (None, ""):            # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edge_sdk.defaults import DEFAULT_DEPTH  # noqa: E402
from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS, MAX_NEW_TOKENS  # noqa: E402
from examples._common import (  # noqa: E402
    OFFLINE_TIMEOUT_S, backend, check_server, int_range, load_draft, run_main,
)

STAT_KEYS = ("acceptance_rate", "mean_accepted_length", "ttft_s", "tpot_s",
             "throughput_tok_s", "target_passes_per_token", "uplink_bytes_per_token",
             "downlink_bytes_per_token", "wasted_draft_tokens", "committed_tokens")
HELP = "commands: /stats  /reset  /help  /quit"


class ChatSession:
    """A conversation with history, on an open :class:`EdgeClient`.

    Args:
        client: the EdgeClient (its tokenizer's chat template formats the history;
            without a template, ``edge_sdk.openai_server.chat_prompt_ids``'s fallback).
        system: optional system message.
        sampling, max_new_tokens, seed: per-reply generation settings.
    """

    def __init__(self, client, system: str | None = None, sampling=None,
                 max_new_tokens: int = 256, seed: int = 0):
        self.client, self.system = client, system
        self.sampling, self.max_new_tokens, self.seed = sampling, max_new_tokens, seed
        self.history: list[dict] = []
        self.last_result = None
        self.last_pieces: list[str] = []     # the streamed texts of the last reply
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []
        self.last_result, self.last_pieces = None, []

    def prompt_ids(self) -> list[int]:
        from edge_sdk.openai_server import chat_prompt_ids

        return chat_prompt_ids(self.client.tokenizer, self.history)

    async def send(self, text: str, on_text=None):
        """Add a user turn, stream the reply (``on_text(piece)`` per committed token's
        text), add it as the assistant turn; returns the GenerationResult."""
        self.history.append({"role": "user", "content": text})
        gen = self.client.stream(prompt_ids=self.prompt_ids(), sampling=self.sampling,
                                 max_new_tokens=self.max_new_tokens,
                                 seed=self.seed + len(self.history))
        pieces = []
        try:
            async for ev in gen:
                pieces.append(ev.text)
                if on_text and ev.text:
                    on_text(ev.text)
        except BaseException:
            self.history.pop()        # the turn failed: keep the history consistent
            raise
        res = gen.result()
        self.history.append({"role": "assistant", "content": res.text})
        self.last_result, self.last_pieces = res, pieces
        return res

    def stats(self) -> dict:
        if self.last_result is None:
            return {}
        m = self.last_result.metrics
        return {k: m[k] for k in STAT_KEYS if k in m} | {
            "finish_reason": self.last_result.finish_reason,
            "prompt_tokens": len(self.last_result.prompt_ids),
            "completion_tokens": len(self.last_result.token_ids)}


def print_stats(stats: dict, out=None) -> None:
    out = out or sys.stdout
    if not stats:
        print("no reply yet", file=out)
        return
    width = max(map(len, stats))
    for k, v in stats.items():
        print(f"  {k:<{width}}  {v:.4g}" if isinstance(v, float) else f"  {k:<{width}}  {v}",
              file=out)


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


async def _read_line(prompt: str) -> str | None:
    try:
        return await asyncio.to_thread(input, prompt)
    except EOFError:
        return None


async def chat_loop(session: ChatSession, show_stats: bool = False) -> None:
    """The interactive loop (stdin/stdout)."""
    print(f"specrelay chat ({HELP})")
    while True:
        line = await _read_line("you> ")
        if line is None:
            print()
            return
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd = line.split()[0].lower()
            if cmd in ("/quit", "/exit", "/q"):
                return
            if cmd == "/stats":
                print_stats(session.stats())
            elif cmd == "/reset":
                session.reset()
                print("(conversation cleared)")
            else:
                print(HELP)
            continue
        _write("bot> ")
        try:
            await session.send(line, on_text=_write)
        except Exception as e:  # noqa: BLE001 - keep the chat alive
            print(f"\n[error: {e}]")
            continue
        print()
        if show_stats:
            print_stats(session.stats())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running `specrelay serve` (default: start "
                   "a signed server in this process)")
    p.add_argument("--api-key", default=os.environ.get("SPECRELAY_API_KEY"),
                   help="key for --url (env SPECRELAY_API_KEY)")
    p.add_argument("--target", default="qwen2.5-coder-1.5b",
                   help="in-process target model (smollm2-135m: the small pair)")
    p.add_argument("--draft", default=None, help="draft model (default: the demo draft)")
    p.add_argument("--depth", type=int_range(1, MAX_DRAFT_TOKENS), default=DEFAULT_DEPTH,
                   help="draft depth (tokens per block); the SDK's default policy also "
                   "drafts the next block while one is verified (IPDG + send-ahead)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (the draft and an in-process target share them; "
                        "0 = torch's default)")
    p.add_argument("--prompt", default=None,
                   help="non-interactive: one turn, print the streamed reply, exit")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-new-tokens", type=int_range(1, MAX_NEW_TOKENS), default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats", action="store_true", help="print the metrics after each reply")
    return p


async def _run(args, url, signer, drafter, tok) -> ChatSession:
    from edge_sdk import EdgeClient, SamplingConfig

    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p)
    async with EdgeClient(url, drafter, tok, depth=args.depth, signer=signer,
                          chat=False, offline_timeout_s=OFFLINE_TIMEOUT_S) as client:
        session = ChatSession(client, args.system, sampling, args.max_new_tokens, args.seed)
        if args.prompt is not None:
            await session.send(args.prompt, on_text=_write)
            print()
            if args.stats:
                print_stats(session.stats())
        else:
            await chat_loop(session, args.stats)
        return session


def main(argv: list[str] | None = None, *, drafter=None, tokenizer=None) -> ChatSession:
    """Run the chat; returns the :class:`ChatSession` (history, last result, streamed
    pieces). ``drafter``/``tokenizer`` skip loading the draft (tests)."""
    args = build_parser().parse_args(argv)
    from edge_sdk import SamplingConfig

    SamplingConfig(temperature=args.temperature, top_p=args.top_p)  # ValueError: bad value
    if args.url:
        check_server(args.url, args.api_key)        # fail fast, before models load
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if drafter is None:
        drafter, tokenizer = load_draft(args.draft, args.target)
    with backend(args.url, args.api_key, args.target, tokenizer,
                 log=lambda m: print(m, file=sys.stderr)) as b:
        return asyncio.run(_run(args, b.url, b.signer, drafter, tokenizer))


if __name__ == "__main__":
    run_main(main)
