"""The robot's command language: :class:`Action`, :func:`parse_action` (one reply line
to a command, tolerant of list markers and synonyms), and the check of an instruction
against what ran (:func:`expected_actions`, :func:`satisfied`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Action", "ParseError", "parse_action", "expected_actions", "satisfied",
           "DIRECTIONS"]

DIRECTIONS = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0),
              "up": (0, 1), "down": (0, -1), "right": (1, 0), "left": (-1, 0)}
CANONICAL_DIR = {"up": "north", "down": "south", "right": "east", "left": "west"}


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
