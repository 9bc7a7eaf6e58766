"""The simulated robot: a grid world with a battery, a held object and objects lying
around; :meth:`Robot.execute` applies one :class:`~examples.robot_commands.Action`
(a failed action changes nothing)."""

from __future__ import annotations

from dataclasses import dataclass, field

from examples.robot_commands import DIRECTIONS, Action

__all__ = ["Outcome", "Robot", "default_world", "SCRIPTED_INSTRUCTIONS", "MOVE_COST",
           "HANDLE_COST"]

MOVE_COST, HANDLE_COST = 5, 2     # battery percent per step moved / per pick or drop


@dataclass
class Outcome:
    """What one action did: whether it succeeded, and the line the model reads."""

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
