"""What the robot's model is told: the system prompt with the command list, few-shot
turns (including a failure and its fix), and the observation after a round that did not
finish cleanly."""

from __future__ import annotations

from examples.robot_commands import Action
from examples.robot_world import Outcome, Robot

__all__ = ["SYSTEM", "FEW_SHOT", "base_messages", "observation"]

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
