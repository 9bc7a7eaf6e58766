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

Importable: :func:`parse_action`, :class:`Robot`, :class:`LineBuffer`,
:func:`run_round`, :func:`run_agent`, :func:`main`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):            # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples._common import backend, load_draft  # noqa: E402

# ------------------------------------------------------------------------- actions

DIRECTIONS = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0),
              "up": (0, 1), "down": (0, -1), "right": (1, 0), "left": (-1, 0)}
CANONICAL_DIR = {"up": "north", "down": "south", "right": "east", "left": "west"}
MOVE_COST, HANDLE_COST = 5, 2
STOP = ["\ndone"]            # a reply ends with a line "done"


class ParseError(ValueError):
    """A line that is not a robot command."""


@dataclass(frozen=True)
class Action:
    """One command: kind in move/pick/drop/charge/say/done."""

    kind: str
    arg: str | None = None        # direction (move), object (pick/drop), text (say)
    steps: int = 0                # move only

    def __str__(self) -> str:
        if self.kind == "move":
            return f"move {self.arg} {self.steps}"
        return f"{self.kind} {self.arg}" if self.arg else self.kind


_NUMBER_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
                 "seven": 7, "eight": 8, "nine": 9, "ten": 10, "a": 1, "an": 1}
_DIR = "|".join(DIRECTIONS)
_NUM = r"\d+|" + "|".join(_NUMBER_WORDS)
_MOVE = [re.compile(rf"^(?:move|go|walk|drive|head)\s+(?P<dir>{_DIR})\s+(?P<n>{_NUM})"
                    r"(?:\s+(?:steps?|squares?|cells?|times?))?$"),
         re.compile(rf"^(?:move|go|walk|drive|head)\s+(?P<n>{_NUM})\s+"
                    rf"(?:steps?\s+|squares?\s+|cells?\s+)?(?P<dir>{_DIR})$"),
         re.compile(rf"^(?:move|go|walk|drive|head)\s+(?P<dir>{_DIR})$")]
_PICK = re.compile(r"^(?:pick\s+up|pick|grab|take|get)\s+(?:the\s+|a\s+|an\s+)?"
                   r"(?P<obj>[a-z][\w -]*)$")
_DROP = re.compile(r"^(?:drop|put\s+down|release)(?:\s+(?:the\s+|a\s+)?(?P<obj>[a-z][\w -]*))?$")
_CHARGE = re.compile(r"^(?:charge|recharge)(?:\s+(?:the\s+|your\s+|my\s+)?battery)?$")
_SAY = re.compile(r"^(?:say|said|speak|tell)\s*:?\s+(?P<text>.+)$", re.I)
_DONE = re.compile(r"^(?:done|finished|stop)$")


def parse_action(line: str) -> Action:
    """Parse one reply line into an :class:`Action`.

    Tolerates list markers (``-``, ``1.``), a trailing period and common synonyms
    (``go``/``walk``, ``pick up``/``grab``, ``put down``, ``2 steps``).
    Raises:
        ParseError: the line is no command (blank lines included).
    """
    raw = re.sub(r"^\s*(?:[-*\u2022>]+|\d+[.)])\s*", "", line).strip()
    say = _SAY.match(raw)
    if say:
        return Action("say", say.group("text").strip())
    s = re.sub(r"\s+", " ", raw.lower().rstrip(".!;,")).strip()
    if not s:
        raise ParseError("empty line")
    for i, rx in enumerate(_MOVE):
        m = rx.match(s)
        if m:
            n = m.group("n") if i < 2 else "1"
            steps = int(n) if n.isdigit() else _NUMBER_WORDS[n]
            if steps < 1:
                raise ParseError(f"move needs at least 1 step: {line!r}")
            d = m.group("dir")
            return Action("move", CANONICAL_DIR.get(d, d), steps)
    m = _PICK.match(s)
    if m:
        return Action("pick", m.group("obj").strip())
    m = _DROP.match(s)
    if m:
        return Action("drop", (m.group("obj") or "").strip() or None)
    if _CHARGE.match(s):
        return Action("charge")
    if _DONE.match(s):
        return Action("done")
    raise ParseError(f"not a command: {line.strip()!r}")


# ------------------------------------------------------------------------- simulator

@dataclass
class Outcome:
    ok: bool
    message: str


@dataclass
class Robot:
    """A grid world: ``x`` east, ``y`` north, both in ``0..size-1``."""

    size: int = 10
    x: int = 0
    y: int = 0
    battery: int = 100
    held: str | None = None
    objects: dict = field(default_factory=dict)      # name -> (x, y), not held ones
    said: list = field(default_factory=list)
    history: list = field(default_factory=list)      # (action str, ok, message)

    @property
    def pos(self) -> tuple[int, int]:
        return (self.x, self.y)

    def state(self) -> str:
        held = self.held or "nothing"
        return f"at ({self.x},{self.y}), battery {self.battery}, holding {held}"

    def snapshot(self) -> dict:
        return {"pos": self.pos, "battery": self.battery, "held": self.held,
                "objects": {k: tuple(v) for k, v in sorted(self.objects.items())},
                "said": list(self.said)}

    def _resolve(self, name: str, candidates) -> str | None:
        """An object name the robot knows, matched by whole name or any of its words
        ("red cup" -> "cup")."""
        name = name.lower().strip()
        if name in candidates:
            return name
        for w in reversed(name.split()):
            if w in candidates:
                return w
        return None

    def _where(self, obj: str) -> str:
        ox, oy = self.objects[obj]
        dx, dy = ox - self.x, oy - self.y
        parts = ([f"{abs(dx)} {'east' if dx > 0 else 'west'}"] if dx else []) + \
                ([f"{abs(dy)} {'north' if dy > 0 else 'south'}"] if dy else [])
        return f"the {obj} is {' and '.join(parts)} of you"

    def execute(self, a: Action) -> Outcome:
        """Apply one action; a failed action changes nothing."""
        out = self._execute(a)
        self.history.append((str(a), out.ok, out.message))
        return out

    def _execute(self, a: Action) -> Outcome:
        if a.kind == "move":
            dx, dy = DIRECTIONS[a.arg]
            nx, ny = self.x + dx * a.steps, self.y + dy * a.steps
            if not (0 <= nx < self.size and 0 <= ny < self.size):
                return Outcome(False, f"{a} failed: that leaves the {self.size}x{self.size} "
                                      "grid")
            cost = MOVE_COST * a.steps
            if self.battery < cost:
                return Outcome(False, f"{a} failed: battery too low (battery "
                                      f"{self.battery}, needs {cost})")
            self.x, self.y, self.battery = nx, ny, self.battery - cost
            return Outcome(True, f"{a}: ok")
        if a.kind == "pick":
            if self.held and self._resolve(a.arg, {self.held}):
                return Outcome(True, f"pick {self.held}: ok, already holding it")
            if self.held:
                return Outcome(False, f"{a} failed: already holding the {self.held}")
            obj = self._resolve(a.arg, self.objects)
            if obj is None:
                return Outcome(False, f"{a} failed: there is no {a.arg}")
            if self.objects[obj] != self.pos:
                return Outcome(False, f"{a} failed: no {obj} here, {self._where(obj)}")
            if self.battery < HANDLE_COST:
                return Outcome(False, f"{a} failed: battery too low")
            del self.objects[obj]
            self.held, self.battery = obj, self.battery - HANDLE_COST
            return Outcome(True, f"pick {obj}: ok")
        if a.kind == "drop":
            if not self.held:
                return Outcome(False, f"{a} failed: holding nothing")
            if a.arg and self._resolve(a.arg, {self.held}) is None:
                return Outcome(False, f"{a} failed: holding the {self.held}, not {a.arg}")
            if self.battery < HANDLE_COST:
                return Outcome(False, f"{a} failed: battery too low")
            self.objects[self.held] = self.pos
            obj, self.held, self.battery = self.held, None, self.battery - HANDLE_COST
            return Outcome(True, f"drop {obj}: ok")
        if a.kind == "charge":
            self.battery = 100
            return Outcome(True, "charge: ok")
        if a.kind == "say":
            self.said.append(a.arg)
            return Outcome(True, f"said {a.arg!r}")
        if a.kind == "done":
            return Outcome(True, "done")
        return Outcome(False, f"unknown action {a.kind}")


def default_world() -> Robot:
    """The scripted scenario's world: a low battery, a cup 3 east, a ball further up."""
    return Robot(battery=40, objects={"cup": (3, 0), "ball": (3, 4)})


SCRIPTED_INSTRUCTIONS = [
    "move east 3, then pick up the cup",
    "go north 5 and say I am here",
    "walk south 2 steps and drop the cup",
    "say good morning",
]

# ------------------------------------------------------------------------- checking

_CLAUSE_SPLIT = re.compile(r"\s*,\s*(?:and\s+)?(?:then\s+)?|\s+then\s+|\s+and\s+(?:then\s+)?"
                           r"(?=(?:move|go|walk|drive|head|pick|grab|take|get|drop|put|"
                           r"release|charge|recharge|say|speak|tell)\b)", re.I)


def expected_actions(instruction: str) -> list[Action] | None:
    """The commands an instruction asks for, or ``None`` when it cannot be read as a
    sequence of commands (then completion is not checked).

    ``"move east 3, then pick up the cup"`` -> ``[move east 3, pick cup]``.
    """
    clauses = [c for c in _CLAUSE_SPLIT.split(instruction.strip()) if c and c.strip()]
    try:
        acts = [parse_action(c) for c in clauses]
    except ParseError:
        return None
    acts = [a for a in acts if a.kind != "done"]
    return acts or None


def _norm_text(t: str | None) -> str:
    return re.sub(r"[^a-z0-9 ]", "", (t or "").lower()).strip()


def satisfied(wanted: list[Action], done: list[Action]) -> bool:
    """Whether every wanted command is among the successfully executed ones (each
    executed command matches at most one wanted; ``say`` compares the text without case
    or punctuation; ``drop`` without an object matches any drop)."""
    pool = list(done)
    for w in wanted:
        for i, a in enumerate(pool):
            if a.kind != w.kind:
                continue
            if w.kind == "say":
                ok = _norm_text(w.arg) in _norm_text(a.arg)
            elif w.kind == "drop" and not w.arg:
                ok = True
            else:
                ok = (a.arg, a.steps) == (w.arg, w.steps)
            if ok:
                del pool[i]
                break
        else:
            return False
    return True


# ------------------------------------------------------------------------- prompt

SYSTEM = ("You control a robot on a grid. Answer with robot commands only, one per line. "
          "Commands:\nmove <north|south|east|west> <steps>\npick <object>\ndrop <object>\n"
          "charge\nsay <text>\ndone\nDo only what the instruction asks, then write done. "
          "If an observation reports a failure, fix it.")

FEW_SHOT = [
    [("go north 2 and pick up the ball", "move north 2\npick ball\ndone")],
    [("say good night", "say good night\ndone")],
    [("walk east 3 steps, then drop the box", "move east 3\ndrop box\ndone")],
    [("go west 6", "move west 6\ndone"),
     ("Observation: move west 6 failed: battery too low (battery 10, needs 30). "
      "State: at (7,1), battery 10, holding nothing.", "charge\nmove west 6\ndone")],
    [("grab the key", "pick key\ndone"),
     ("Observation: pick key failed: no key here, the key is 2 east of you. "
      "State: at (1,1), battery 90, holding nothing.", "move east 2\npick key\ndone")],
    [("go south 4 and tell me you arrived", "move south 4\nsay I arrived\ndone")],
    [("recharge, then greet everyone", "charge\nsay hello everyone\ndone")],
]


def base_messages() -> list[dict]:
    """System prompt + few-shot turns (each example: user instruction, assistant
    commands, optionally an observation and the fix)."""
    msgs = [{"role": "system", "content": SYSTEM}]
    for example in FEW_SHOT:
        for user, assistant in example:
            msgs += [{"role": "user", "content": user},
                     {"role": "assistant", "content": assistant}]
    return msgs


def observation(results: list[tuple[Action, Outcome]], unparseable: list[str],
                robot: Robot) -> str:
    """The next user turn after a round that did not finish cleanly."""
    parts = [o.message for a, o in results if a.kind != "done"]
    if unparseable and not results:
        parts.append("no valid command; answer with commands from the list only")
    return "Observation: " + ". ".join(parts or ["nothing happened"]) + \
        f". State: {robot.state()}."


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
                "tpot_ms": 1000 * m.get("tpot_s", 0.0), "ttft_ms": 1000 * m.get("ttft_s", 0.0),
                "actions_ok": len(self.executed()),
                "actions_failed": sum(not o.ok for _, o in self.actions),
                "unparseable": len(self.unparseable), "finish_reason": self.finish_reason}


def _quiet(*_a, **_k):
    pass


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
    buf, streamed, at_token = LineBuffer(), [], []
    lines, actions, bad = [], [], []
    state = {"abort": False, "done": False, "bad_run": 0}

    def handle(line: str) -> None:
        lines.append(line)
        try:
            a = parse_action(line)
        except ParseError as e:
            if line.strip():
                bad.append(line)
                state["bad_run"] += 1
                log(f"    [yellow]? skipped unparseable line {line!r} ({e})[/yellow]")
                if state["bad_run"] >= max_bad_lines:
                    log(f"    [yellow]{max_bad_lines} unparseable lines in a row: cut "
                        "off[/yellow]")
                    state["abort"] = True
            return
        state["bad_run"] = 0
        out = robot.execute(a)
        actions.append((a, out))
        at_token.append(len(streamed))
        color = "green" if out.ok else "red"
        log(f"    [{color}]> {a}[/{color}]  {out.message}   [dim]{robot.state()}[/dim]")
        if not out.ok or a.kind == "done":
            state["done"] = a.kind == "done"
            state["abort"] = True
        elif len(actions) >= max_actions:
            log("    [yellow]too many actions in one reply: cut off[/yellow]")
            state["abort"] = True

    try:
        async for ev in it:
            streamed.append(ev.text)
            for line in buf.feed(ev.text):
                handle(line)
                if state["abort"]:
                    break
            if state["abort"]:
                break
    finally:
        await it.aclose()
    res = gen.result()
    finish = res.finish_reason or "aborted"
    if not state["abort"]:
        rest = buf.flush()
        if rest.strip():
            handle(rest)
        if res.finish_reason == "stop" and res.token_ids[-1] not in _eos(client):
            state["done"] = True      # ended by the stop string "\ndone"
    return RoundRecord(instruction_index, instruction, round_no, res.text, "".join(streamed),
                       list(res.token_ids), finish, lines, actions, bad, state["done"],
                       res.metrics, at_token)


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
                    "unparseable lines)")
    for col in ("instr", "round", "tokens", "accept", "TPOT ms", "TTFT ms", "ok", "failed",
                "skipped", "finish"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in report.rounds:
        s = r.summary()
        t.add_row(str(s["instruction"]), str(s["round"]), str(s["tokens"]),
                  f"{s['acceptance_rate']:.2f}", f"{s['tpot_ms']:.0f}", f"{s['ttft_ms']:.0f}",
                  str(s["actions_ok"]), str(s["actions_failed"]), str(s["unparseable"]),
                  s["finish_reason"])
    con.print(t)
    tok = sum(r.tokens for r in report.rounds)
    checked = [c for c in report.completed if c is not None]
    unchecked = len(report.completed) - len(checked)
    note = f" ({unchecked} not checkable, not counted)" if unchecked else ""
    con.print(f"instructions completed: {sum(checked)}/{len(checked)}{note} (every command "
              f"asked for ran)   rounds: {len(report.rounds)}   tokens: {tok}   wall: {report.wall_s:.1f}s")
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
    p.add_argument("--depth", type=int, default=3, help="draft depth (tokens per block)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (the draft and an in-process target share them; "
                        "0 = torch's default)")
    p.add_argument("--instructions", default="scripted",
                   help="file with one instruction per line, or 'scripted' (default)")
    p.add_argument("--max-rounds", type=int, default=3, help="rounds per instruction")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per round")
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
                          chat=False) as client:
        return await run_agent(client, robot, instructions, max_rounds=args.max_rounds,
                               max_new_tokens=args.max_new_tokens, log=log)


def main(argv: list[str] | None = None, robot: Robot | None = None, *, drafter=None,
         tokenizer=None) -> AgentReport:
    """Run the scenario; returns the :class:`AgentReport` (also printed).
    ``robot`` replaces the default world; ``drafter``/``tokenizer`` skip loading the
    draft (tests)."""
    from rich.console import Console

    args = build_parser().parse_args(argv)
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
    main()
    sys.exit(0)
