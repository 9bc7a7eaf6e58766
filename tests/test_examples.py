"""The examples: robot agent loop and terminal chat.

Parser/simulator unit tests run without a model. The ``real_model`` tests run the
examples' ``main`` on the real SmolLM2-135M-Instruct target and the default draft
(greedy), sharing one in-process signed server and one load of the models per module.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from examples import chat_app, robot_agent, robot_prompt
from examples.robot_agent import LineBuffer
from examples.robot_commands import (Action, ParseError, expected_actions, parse_action,
                                     satisfied)
from examples.robot_world import SCRIPTED_INSTRUCTIONS, Robot, default_world

# ----------------------------------------------------------------------- no model


@pytest.mark.parametrize("script", ["chat_app.py", "robot_agent.py"])
def test_bad_input_is_one_line_before_any_model_loads(script):
    """A malformed key, a bad sampling value: one ``Error:`` line naming the fix, exit
    1; an out-of-range depth or token count: argparse's usage error, exit 2; no
    traceback, no model load (seconds)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cases = [(["--url", "http://127.0.0.1:9", "--api-key", "bogus"], 1,
              "--api-key / SPECRELAY_API_KEY"),
             (["--depth", "99"], 2, "not in the range 1..16"),
             (["--max-new-tokens", "0"], 2, "not in the range 1..32768")]
    if script == "chat_app.py":
        cases += [(["--temperature", "-1"], 1, "temperature"),
                  (["--top-p", "3"], 1, "top_p")]
    for args, code, needle in cases:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, str(root / "examples" / script), *args],
                           capture_output=True, text=True, timeout=120, cwd=root)
        err = r.stderr.strip().splitlines()
        assert r.returncode == code and "Traceback" not in r.stderr, (args, r.stderr)
        assert needle in err[-1] and time.monotonic() - t0 < 60, (args, err)
        assert code == 2 or err[-1].startswith("Error: ")



@pytest.mark.parametrize("line, want", [
    ("move east 3", Action("move", "east", 3)),
    ("1. go north 2 steps", Action("move", "north", 2)),
    ("walk 2 steps south.", Action("move", "south", 2)),
    ("move west two", Action("move", "west", 2)),
    ("- pick up the red cup", Action("pick", "red cup")),
    ("grab ball", Action("pick", "ball")),
    ("drop", Action("drop")),
    ("Drop the cup.", Action("drop", "cup")),
    ("charge battery", Action("charge")),
    ("say Good Morning", Action("say", "Good Morning")),
    ("done", Action("done")),
])
def test_parse_action(line, want):
    assert parse_action(line) == want
    assert parse_action(str(want)) == want          # canonical form round-trips


@pytest.mark.parametrize("line", ["", "   ", "move to the charger", "shine", "move east 0",
                                  "fly north 3", "pick"])
def test_parse_action_rejects(line):
    with pytest.raises(ParseError):
        parse_action(line)


@pytest.mark.parametrize("instruction, want", [
    ("move east 3, then pick up the cup", ["move east 3", "pick cup"]),
    ("go north 5 and say I am here", ["move north 5", "say I am here"]),
    ("walk south 2 steps and drop the cup", ["move south 2", "drop cup"]),
    ("say good morning", ["say good morning"]),
    ("charge, then move west 1", ["charge", "move west 1"]),
])
def test_expected_actions(instruction, want):
    assert [str(a) for a in expected_actions(instruction)] == want


def test_expected_actions_unreadable_is_unchecked():
    assert expected_actions("dance a little") is None
    assert expected_actions("move east 3 and then tidy up") is None
    assert all(expected_actions(i) for i in SCRIPTED_INSTRUCTIONS)


def test_completion_needs_every_asked_command():
    """A round that ends with ``done`` after skipping a command is not completed."""
    want = expected_actions("move east 3, then pick up the cup")
    assert not satisfied(want, [Action("move", "east", 3)])
    assert not satisfied(want, [Action("move", "east", 2), Action("pick", "cup")])
    assert satisfied(want, [Action("pick", "cup"), Action("move", "east", 3)])
    # one executed command satisfies one asked command, not two
    assert not satisfied([Action("move", "east", 1)] * 2, [Action("move", "east", 1)])
    assert satisfied(expected_actions("say good morning"), [Action("say", "Good morning!")])
    assert satisfied([Action("drop")], [Action("drop", "cup")])


def test_robot_simulator_rules():
    r = Robot(battery=30, objects={"cup": (2, 0)})
    assert not r.execute(parse_action("move west 1")).ok            # off the grid
    assert not r.execute(parse_action("pick cup")).ok               # not here
    assert "2 east" in r.history[-1][2]
    assert r.execute(parse_action("move east 2")).ok and r.pos == (2, 0) and r.battery == 20
    assert r.execute(parse_action("pick up the cup")).ok and r.held == "cup"
    assert "cup" not in r.objects
    assert r.execute(parse_action("pick cup")).ok                   # already held: no-op
    out = r.execute(parse_action("move north 4"))                    # needs 20, has 18
    assert not out.ok and "battery too low" in out.message and r.pos == (2, 0)
    assert r.execute(parse_action("charge")).ok and r.battery == 100
    assert r.execute(parse_action("move north 4")).ok and r.pos == (2, 4)
    assert not r.execute(parse_action("drop ball")).ok
    assert r.execute(parse_action("drop")).ok and r.objects["cup"] == (2, 4) and not r.held
    assert not r.execute(parse_action("drop")).ok
    assert r.execute(parse_action("say hi there")).ok and r.said == ["hi there"]


def test_line_buffer():
    b = LineBuffer()
    assert b.feed("move ea") == []
    assert b.feed("st 3\npick") == ["move east 3"]
    assert b.feed(" cup\n\nsay x") == ["pick cup", ""]
    assert b.flush() == "say x" and b.flush() == ""


# ----------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def real():
    """(backend with url/signer/api_key, TorchDrafter factory, tokenizer)."""
    from edge_sdk.drafters.torch import TorchDrafter
    from edge_sdk.models import load_model
    from examples._common import local_server
    from specrelay_cli.options import default_draft

    target, tok = load_model("smollm2-135m")
    dmodel, _ = load_model(default_draft("smollm2-135m"))
    with local_server(target, tok) as b:
        yield b, (lambda: TorchDrafter(dmodel)), tok


def _replay(rounds, start: Robot) -> Robot:
    """Re-execute every handled line of every round in order on a fresh world."""
    for rec in rounds:
        outcomes = []
        for line in rec.lines:
            try:
                a = parse_action(line)
            except ParseError:
                continue
            outcomes.append((a, start.execute(a)))
        assert [(str(a), o.ok) for a, o in outcomes] == \
               [(str(a), o.ok) for a, o in rec.actions]
    return start


@pytest.mark.real_model
def test_robot_agent_real_model(real, tmp_path):
    b, make_drafter, tok = real
    instructions = tmp_path / "instructions.txt"
    instructions.write_text("# scripted test run\nmove east 3, then pick up the cup\n"
                            "go north 5 and say I am here\n")
    robot = default_world()
    start = default_world().snapshot()
    t0 = time.perf_counter()
    report = robot_agent.main(["--url", b.url, "--api-key", b.api_key, "--instructions",
                               str(instructions), "--max-rounds", "2", "--quiet",
                               "--threads", "0"],
                              robot=robot, drafter=make_drafter(), tokenizer=tok)
    assert time.perf_counter() - t0 < 60
    assert report.robot is robot and report.rounds
    assert [r.instruction_index for r in report.rounds][0] == 1
    for rec in report.rounds:
        # tokens streamed in order: the stream is the final text (a round cut off after a
        # failed action may hold back an undecided tail, never anything else)
        if rec.finish_reason == "aborted":
            assert rec.text.startswith(rec.streamed)
        else:
            assert rec.streamed == rec.text
        # the lines handled are exactly the lines of the streamed text, in order
        assert rec.lines == rec.streamed.split("\n")[:len(rec.lines)]
        assert rec.tokens == len(rec.token_ids) > 0
        assert 0.0 <= rec.metrics["acceptance_rate"] <= 1.0
        for line in rec.unparseable:
            with pytest.raises(ParseError):
                parse_action(line)
    executed = [a for rec in report.rounds for a in rec.executed()]
    assert executed, [r.text for r in report.rounds]
    # the simulator's state is what the parsed actions imply
    replay = _replay(report.rounds, default_world())
    assert replay.snapshot() == robot.snapshot()
    assert robot.snapshot() != start
    assert robot.history == replay.history
    # the completion count is honest: completed iff every asked command ran successfully
    lines = [ln for ln in instructions.read_text().splitlines() if not ln.startswith("#")]
    assert len(report.completed) == len(report.ended_cleanly) == len(lines)
    for i, text in enumerate(lines, 1):
        ran = [a for r in report.rounds if r.instruction_index == i
               for a, o in r.actions if o.ok and a.kind != "done"]
        assert report.completed[i - 1] == satisfied(expected_actions(text), ran)


@pytest.mark.real_model
def test_robot_round_executes_actions_while_streaming(real):
    """Actions execute as their lines complete: the first one runs before the reply's
    last token has arrived."""
    from edge_sdk import EdgeClient

    b, make_drafter, tok = real

    async def go():
        async with EdgeClient(b.url, make_drafter(), tok, depth=3, signer=b.signer,
                              chat=False) as c:
            robot = Robot(battery=100, objects={"cup": (3, 0)})
            msgs = robot_prompt.base_messages() + [
                {"role": "user", "content": "move east 3, then pick up the cup"}]
            return await robot_agent.run_round(c, robot, msgs), robot

    rec, robot = asyncio.run(go())
    assert rec.executed(), rec.text
    assert len(rec.action_at_token) == len(rec.actions)
    assert rec.action_at_token == sorted(rec.action_at_token)
    assert rec.action_at_token[0] < rec.tokens
    assert robot.snapshot() != Robot(battery=100, objects={"cup": (3, 0)}).snapshot()


@pytest.mark.real_model
def test_chat_app_prompt_real_model(real, capsys):
    from edge_sdk import EdgeClient
    from edge_sdk.openai_server import chat_prompt_ids

    b, make_drafter, tok = real
    t0 = time.perf_counter()
    session = chat_app.main(["--url", b.url, "--api-key", b.api_key, "--prompt",
                             "Name three colors.", "--max-new-tokens", "24", "--stats",
                             "--threads", "0"],
                            drafter=make_drafter(), tokenizer=tok)
    assert time.perf_counter() - t0 < 60
    out = capsys.readouterr().out
    res = session.last_result
    assert res.text.strip() and len(res.token_ids) > 1
    assert "".join(session.last_pieces) == res.text          # streamed in order
    assert sum(1 for p in session.last_pieces if p) > 1
    assert out.startswith(res.text + "\n")                   # printed as streamed
    assert "acceptance_rate" in out and "completion_tokens" in out
    msgs = [{"role": "user", "content": "Name three colors."}]
    assert session.history == msgs + [{"role": "assistant", "content": res.text}]
    assert res.prompt_ids == chat_prompt_ids(tok, msgs)
    assert res.prompt_ids == tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)

    async def reference():      # the target alone, through the same server
        async with EdgeClient(b.url, None, tok, signer=b.signer, chat=False) as c:
            return await c.generate(prompt_ids=res.prompt_ids, max_new_tokens=24)
    assert asyncio.run(reference()).token_ids == res.token_ids


@pytest.mark.real_model
def test_chat_session_keeps_history(real):
    """Two turns: the second prompt is the chat template over the whole history."""
    from edge_sdk import EdgeClient
    from edge_sdk.openai_server import chat_prompt_ids

    b, make_drafter, tok = real

    async def go():
        async with EdgeClient(b.url, make_drafter(), tok, depth=3, signer=b.signer,
                              chat=False) as c:
            s = chat_app.ChatSession(c, system="You are terse.", max_new_tokens=8)
            r1 = await s.send("Hi!")
            r2 = await s.send("What did I just say?")
            return s, r1, r2

    s, r1, r2 = asyncio.run(go())
    assert [m["role"] for m in s.history] == ["system", "user", "assistant", "user",
                                              "assistant"]
    assert s.history[2]["content"] == r1.text
    assert r2.prompt_ids == chat_prompt_ids(tok, s.history[:4])
    assert s.stats()["completion_tokens"] == len(r2.token_ids)


def test_a_round_of_one_verified_block_has_no_tpot():
    """TPOT is the time between tokens after the first; a round whose tokens all came in
    one verified block has none, and the table says ``-`` rather than 0 ms."""
    import io

    from rich.console import Console

    def record(rounds, tpot_s):
        return robot_agent.RoundRecord(0, "go", 0, "", "", [1, 2, 3], "stop", [], [], [],
                                       True, {"rounds": rounds, "tpot_s": tpot_s,
                                              "ttft_s": 0.4})

    assert record(1, 0.0).summary()["tpot_ms"] is None
    assert record(3, 0.05).summary()["tpot_ms"] == pytest.approx(50.0)
    from examples.robot_world import Robot

    report = robot_agent.AgentReport([record(1, 0.0), record(3, 0.05)], Robot(), 1.0, [True])
    out = io.StringIO()
    robot_agent.print_report(report, Console(file=out, width=200))
    rows = [x.split("│") for x in out.getvalue().splitlines() if "stop" in x]
    assert [r[5].strip() for r in rows] == ["-", "50"]       # the TPOT ms column


def test_the_readme_sdk_example_runs(real, capsys):
    """README's SDK snippet, verbatim but for its URL, key and draft (the small pair's,
    which the fixture's server serves): check the API, generate with a stop string and
    sampling, stream."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = readme.split("## The SDK", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    b, _, _ = real
    code, n = re.subn(r'URL, KEY = .*', f'URL, KEY = "{b.url}", "{b.api_key}"', code)
    code, m = re.subn(r'load_model\("qwen2.5-coder-0.5b", dtype="auto"\)',
                      'load_model("smollm2-135m-draft")', code)
    assert n == 1 and m == 1, "the README's SDK snippet changed shape"
    exec(compile(code, "README.md (The SDK)", "exec"), {})
    out = capsys.readouterr().out
    assert out.strip() and "Traceback" not in out
