"""Robot control loop on edge-cloud speculative decoding.

A simulated robot on a grid (position, battery, held object, objects lying around) takes
natural-language instructions. For each instruction the SDK *streams* the model's reply;
the reply is one command per line (taught by few-shot examples in the prompt) and every
line is parsed and executed in the simulator the moment it is complete, while the model
is still generating. The reply ends at the stop string ``"\\ndone"`` (or EOS). When an
action fails (battery too low, nothing to pick up here, ...) the stream is cut off and
the observation goes back to the model as the next user turn: another round, up to
``--max-rounds`` per instruction. Unparseable lines are reported and skipped.

Commands: ``move <north|south|east|west> <steps>``, ``pick <object>``, ``drop [object]``,
``charge``, ``say <text>``, ``done``. Moving costs 5 % battery per step, picking and
dropping 2 %, ``charge`` refills to 100 %.

Run (headless; starts a local signed server with SmolLM2-135M-Instruct unless ``--url``)::

    python examples/robot_agent.py
    python examples/robot_agent.py --url http://127.0.0.1:8000 --api-key sr_live_... \\
        --instructions my_instructions.txt

The command language is :mod:`examples.robot_commands` (:func:`parse_action`), the
simulator :mod:`examples.robot_world` (:class:`Robot`), the prompt
:mod:`examples.robot_prompt`; this module holds the agent loop: :class:`LineBuffer`,
:func:`run_round`, :func:`run_agent`, :func:`main`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):            # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edge_sdk.defaults import DEFAULT_DEPTH  # noqa: E402
from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS, MAX_NEW_TOKENS  # noqa: E402
from examples._common import (  # noqa: E402
    OFFLINE_TIMEOUT_S, backend, check_server, int_range, load_draft, run_main,
)
from examples.robot_commands import (Action, ParseError, expected_actions,  # noqa: E402
                                     parse_action, satisfied)
from examples.robot_prompt import base_messages, observation  # noqa: E402
from examples.robot_world import (SCRIPTED_INSTRUCTIONS, Outcome, Robot,  # noqa: E402
                                  default_world)

STOP = ["\ndone"]            # a reply ends with a line "done"


# ------------------------------------------------------------------------- agent loop


class LineBuffer:
    """Cuts streamed text into complete lines."""

    def __init__(self):
        self.buf = ""

    def feed(self, text: str) -> list[str]:
        self.buf += text
        *lines, self.buf = self.buf.split("\n")
        return lines

    def flush(self) -> str:
        rest, self.buf = self.buf, ""
        return rest


@dataclass
class RoundRecord:
    """One generation of one instruction."""

    instruction_index: int
    instruction: str
    round: int
    text: str                  # the SDK's final text
    streamed: str              # concatenation of the streamed TokenEvent texts
    token_ids: list
    finish_reason: str         # stop / length / aborted (cut off after a failed action)
    lines: list                # every complete line handled, in order
    actions: list              # [(Action, Outcome)] executed, in order
    unparseable: list          # lines that were no command
    done: bool                 # the model said it was done
    metrics: dict
    action_at_token: list = field(default_factory=list)  # tokens streamed when each
    #                                                      action executed

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def failed(self) -> bool:
        return any(not o.ok for _, o in self.actions)

    def executed(self) -> list[str]:
        """The commands that succeeded (``done`` excluded)."""
        return [str(a) for a, o in self.actions if o.ok and a.kind != "done"]

    def summary(self) -> dict:
        m = self.metrics
        return {"instruction": self.instruction_index, "round": self.round,
                "tokens": self.tokens, "acceptance_rate": m.get("acceptance_rate", 0.0),
                # one verified block: every token came at once, TPOT is not defined
                "tpot_ms": 1000 * m["tpot_s"] if m.get("rounds", 0) > 1 else None,
                "ttft_ms": 1000 * m.get("ttft_s", 0.0),
                "actions_ok": len(self.executed()),
                "actions_failed": sum(not o.ok for _, o in self.actions),
                "unparseable": len(self.unparseable), "finish_reason": self.finish_reason}


def _quiet(*_a, **_k):
    pass


class _Round:
    """The lines of one streamed reply, executed as they complete; ``abort`` is set when
    the stream must be cut off (see :func:`run_round`)."""

    def __init__(self, robot: Robot, max_actions: int, max_bad_lines: int, log):
        self.robot, self.max_actions, self.max_bad_lines, self.log = (
            robot, max_actions, max_bad_lines, log)
        self.streamed: list[str] = []
        self.at_token: list[int] = []
        self.lines: list[str] = []
        self.actions: list[tuple[Action, Outcome]] = []
        self.bad: list[str] = []
        self.abort = self.done = False
        self.bad_run = 0

    def _unparseable(self, line: str, e: ParseError) -> None:
        if not line.strip():
            return
        self.bad.append(line)
        self.bad_run += 1
        self.log(f"    [yellow]? skipped unparseable line {line!r} ({e})[/yellow]")
        if self.bad_run >= self.max_bad_lines:
            self.log(f"    [yellow]{self.max_bad_lines} unparseable lines in a row: cut "
                     "off[/yellow]")
            self.abort = True

    def handle(self, line: str) -> None:
        """Parse and execute one complete line."""
        self.lines.append(line)
        try:
            a = parse_action(line)
        except ParseError as e:
            self._unparseable(line, e)
            return
        self.bad_run = 0
        out = self.robot.execute(a)
        self.actions.append((a, out))
        self.at_token.append(len(self.streamed))
        color = "green" if out.ok else "red"
        self.log(f"    [{color}]> {a}[/{color}]  {out.message}   "
                 f"[dim]{self.robot.state()}[/dim]")
        if not out.ok or a.kind == "done":
            self.done = a.kind == "done"
            self.abort = True
        elif len(self.actions) >= self.max_actions:
            self.log("    [yellow]too many actions in one reply: cut off[/yellow]")
            self.abort = True

    async def consume(self, it, buf: LineBuffer) -> None:
        """Feed the stream's text into ``buf``, handling each complete line, until the
        stream ends or the round aborts."""
        async for ev in it:
            self.streamed.append(ev.text)
            for line in buf.feed(ev.text):
                self.handle(line)
                if self.abort:
                    return


async def run_round(client, robot: Robot, messages: list[dict], *, instruction_index: int = 0,
                    instruction: str = "", round_no: int = 1, max_new_tokens: int = 48,
                    max_actions: int = 8, max_bad_lines: int = 3,
                    log=_quiet) -> RoundRecord:
    """Stream one reply and execute its commands line by line as they complete.

    The stream is cut off (``finish_reason="aborted"``) at the first failed action, at
    ``done`` if the model says it before the stop string, after ``max_actions`` or
    after ``max_bad_lines`` unparseable lines in a row.
    """
    from edge_sdk.openai_server import chat_prompt_ids

    ids = chat_prompt_ids(client.tokenizer, messages)
    gen = client.stream(prompt_ids=ids, max_new_tokens=max_new_tokens, stop=STOP, seed=0)
    it = gen.__aiter__()
    buf, rnd = LineBuffer(), _Round(robot, max_actions, max_bad_lines, log)
    try:
        await rnd.consume(it, buf)
    finally:
        await it.aclose()
    res = gen.result()
    finish = res.finish_reason or "aborted"
    if not rnd.abort:
        rest = buf.flush()
        if rest.strip():
            rnd.handle(rest)
        if res.finish_reason == "stop" and res.token_ids[-1] not in _eos(client):
            rnd.done = True      # ended by the stop string "\ndone"
    return RoundRecord(instruction_index, instruction, round_no, res.text,
                       "".join(rnd.streamed), list(res.token_ids), finish, rnd.lines,
                       rnd.actions, rnd.bad, rnd.done, res.metrics, rnd.at_token)


def _eos(client) -> set[int]:
    tok = client.tokenizer
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for t in ("<|im_end|>", "<|endoftext|>"):
        i = tok.convert_tokens_to_ids(t) if t in tok.get_vocab() else None
        if i is not None:
            ids.add(i)
    return ids


@dataclass
class AgentReport:
    rounds: list
    robot: Robot
    wall_s: float
    completed: list            # per instruction: True (every command it asks for ran),
    #                            False, or None (not a readable command list: unchecked)
    ended_cleanly: list = field(default_factory=list)  # per instruction: last round had
    #                                                    no failure and did not run out

    def to_dict(self) -> dict:
        return {"rounds": [r.summary() | {
                    "text": r.text, "unparseable": r.unparseable,
                    "actions": [[str(a), o.ok, o.message] for a, o in r.actions]}
                           for r in self.rounds],
                "completed": self.completed, "ended_cleanly": self.ended_cleanly,
                "final_state": self.robot.snapshot(),
                "wall_s": self.wall_s}


async def run_agent(client, robot: Robot, instructions: list[str], *, max_rounds: int = 3,
                    max_new_tokens: int = 48, log=_quiet) -> AgentReport:
    """The agentic loop: per instruction, rounds of (stream reply, execute, observe)
    until a round ends cleanly (no failed action; ``done`` or end of reply) or
    ``max_rounds``. Each instruction starts from the few-shot prompt; its rounds
    accumulate as chat turns. An instruction counts as completed only when every command
    it asks for (:func:`expected_actions`) was executed successfully in its rounds; a
    clean ending alone is not enough (the model may say ``done`` having skipped one)."""
    t0 = time.perf_counter()
    rounds, completed, clean = [], [], []
    for i, instruction in enumerate(instructions):
        log(f"[bold]instruction {i + 1}:[/bold] {instruction}   [dim]{robot.state()}[/dim]")
        msgs = base_messages() + [{"role": "user", "content": instruction}]
        ok = False
        wanted = expected_actions(instruction)
        ran: list[Action] = []
        for r in range(1, max_rounds + 1):
            rec = await run_round(client, robot, msgs, instruction_index=i + 1,
                                  instruction=instruction, round_no=r,
                                  max_new_tokens=max_new_tokens, log=log)
            rounds.append(rec)
            ran += [a for a, o in rec.actions if o.ok and a.kind != "done"]
            if not rec.failed and (rec.executed() or rec.done) and \
                    rec.finish_reason != "length":
                ok = True
                break
            reply = "\n".join(ln for ln in rec.lines if ln.strip()) or rec.text.strip()
            msgs = msgs + [{"role": "assistant", "content": reply},
                           {"role": "user", "content": observation(
                               rec.actions, rec.unparseable, robot)}]
            log(f"  [dim]{msgs[-1]['content']}[/dim]")
        clean.append(ok)
        completed.append(None if wanted is None else satisfied(wanted, ran))
        if wanted is not None and not completed[-1]:
            log(f"  [yellow]not completed: asked for {', '.join(map(str, wanted))}; ran "
                f"{', '.join(map(str, ran)) or 'nothing'}[/yellow]")
    return AgentReport(rounds, robot, time.perf_counter() - t0, completed, clean)


def print_report(report: AgentReport, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    t = Table(title="robot agent: per-round metrics (ok/failed actions, skipped = "
                    "unparseable lines; TPOT - = all tokens in one verified block)")
    for col in ("instr", "round", "tokens", "accept", "TPOT ms", "TTFT ms", "ok", "failed",
                "skipped", "finish"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in report.rounds:
        s = r.summary()
        tpot = "-" if s["tpot_ms"] is None else f"{s['tpot_ms']:.0f}"
        t.add_row(str(s["instruction"]), str(s["round"]), str(s["tokens"]),
                  f"{s['acceptance_rate']:.2f}", tpot, f"{s['ttft_ms']:.0f}",
                  str(s["actions_ok"]), str(s["actions_failed"]), str(s["unparseable"]),
                  s["finish_reason"])
    con.print(t)
    tok = sum(r.tokens for r in report.rounds)
    checked = [c for c in report.completed if c is not None]
    unchecked = len(report.completed) - len(checked)
    note = f" ({unchecked} not checkable, not counted)" if unchecked else ""
    con.print(f"instructions completed: {sum(checked)}/{len(checked)}{note} (every command "
              f"asked for ran)   rounds: {len(report.rounds)}   tokens: {tok}   "
              f"wall: {report.wall_s:.1f}s")
    con.print(f"final state: {report.robot.state()}; objects "
              f"{report.robot.snapshot()['objects']}; said {report.robot.said}")


# ------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--instructions", default="scripted",
                   help="file with one instruction per line, or 'scripted' (default)")
    p.add_argument("--max-rounds", type=int, default=3, help="rounds per instruction")
    p.add_argument("--max-new-tokens", type=int_range(1, MAX_NEW_TOKENS), default=48,
                   help="tokens per round")
    p.add_argument("--json", dest="as_json", action="store_true",
                   help="print one JSON report instead of the table")
    p.add_argument("--quiet", action="store_true", help="no per-action log")
    return p


def load_instructions(arg: str) -> list[str]:
    if arg == "scripted":
        return list(SCRIPTED_INSTRUCTIONS)
    lines = Path(arg).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


async def _run(args, url, signer, drafter, tok, robot, instructions, log) -> AgentReport:
    from edge_sdk import EdgeClient

    async with EdgeClient(url, drafter, tok, depth=args.depth, signer=signer,
                          chat=False, offline_timeout_s=OFFLINE_TIMEOUT_S) as client:
        return await run_agent(client, robot, instructions, max_rounds=args.max_rounds,
                               max_new_tokens=args.max_new_tokens, log=log)


def main(argv: list[str] | None = None, robot: Robot | None = None, *, drafter=None,
         tokenizer=None) -> AgentReport:
    """Run the scenario; returns the :class:`AgentReport` (also printed).
    ``robot`` replaces the default world; ``drafter``/``tokenizer`` skip loading the
    draft (tests)."""
    from rich.console import Console

    args = build_parser().parse_args(argv)
    if args.url:
        check_server(args.url, args.api_key)        # fail fast, before models load
    instructions = load_instructions(args.instructions)
    stream = sys.stderr if args.as_json else sys.stdout
    con = Console(file=stream, width=None if stream.isatty() else 110)
    log = _quiet if args.quiet else con.print
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if drafter is None:
        drafter, tokenizer = load_draft(args.draft, args.target)
    tok = tokenizer
    robot = robot or default_world()
    with backend(args.url, args.api_key, args.target, tok,
                 log=lambda m: con.print(f"[dim]{m}[/dim]")) as b:
        report = asyncio.run(_run(args, b.url, b.signer, drafter, tok, robot, instructions,
                                  log))
    if args.as_json:
        print(json.dumps(report.to_dict(), default=str))
    else:
        print_report(report, con)
    return report


if __name__ == "__main__":
    run_main(main)
