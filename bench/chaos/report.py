"""The outputs of ``specrelay bench --chaos``: ``chaos.json`` (a list of rows with
exactly the keys fault, runs, identical, lost, duplicated, errors), ``chaos.md`` (the
same table and its notes) and the rich table printed on the console."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from bench.chaos.score import ROW_KEYS, Row

__all__ = ["write_outputs", "markdown", "print_table", "notes"]


def notes(rows: Sequence[Row], header: str = "") -> list[str]:
    """The lines under the table: the setup, each row's note, faults injected, the
    correction requests of the ``correction`` rows (seen / hit), extra target passes of
    the sequential runs, rows whose fault never fired, undocumented exceptions."""
    out = [header] if header else []
    out += [f"- {r.fault}: {r.note}" for r in rows if r.note]
    out.append("- faults injected: " + ", ".join(f"{r.fault} {r.injected}" for r in rows))
    corr = [f"{r.fault} {r.seen} / {r.injected}" for r in rows if r.target == "correction"]
    if corr:
        out.append("- correction requests (seen / hit by the fault): " + ", ".join(corr))
    out += [f"- NEVER FIRED: {r.fault} (no request was hit: the row proves nothing)"
            for r in rows if r.never_fired]
    extra = [f"{r.fault} {r.extra_passes}" for r in rows if r.extra_passes]
    out.append("- extra target passes (sequential runs, vs the fault-free run): "
               + (", ".join(extra) if extra else "none"))
    for r in rows:
        for u in r.undocumented:
            out.append(f"- UNDOCUMENTED exception in {r.fault}: {u}")
    return out


def markdown(rows: Sequence[Row], header: str = "") -> str:
    """``chaos.md``: the table (one line per fault) and :func:`notes`."""
    lines = ["# specrelay bench --chaos", "",
             "| " + " | ".join(ROW_KEYS) + " |", "|" + "---|" * len(ROW_KEYS)]
    lines += ["| " + " | ".join(str(r.as_dict()[k]) for k in ROW_KEYS) + " |" for r in rows]
    return "\n".join(lines + [""] + notes(rows, header)) + "\n"


def write_outputs(rows: Sequence[Row], out_dir: str | Path, header: str = "") -> list[Path]:
    """Write ``chaos.json`` and ``chaos.md`` into ``out_dir`` (created); their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "chaos.json", out / "chaos.md"
    js.write_text(json.dumps([r.as_dict() for r in rows], indent=2) + "\n")
    md.write_text(markdown(rows, header))
    return [js, md]


def print_table(rows: Sequence[Row], header: str = "") -> None:
    """The rows as a rich table on stdout, the notes below it."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="specrelay bench --chaos")
    for k in ROW_KEYS:
        t.add_column(k, justify="left" if k == "fault" else "right")
    for r in rows:
        bad = (r.identical + r.errors < r.runs or r.lost or r.duplicated or r.undocumented
               or r.never_fired)
        t.add_row(*(str(r.as_dict()[k]) for k in ROW_KEYS), style="red" if bad else None)
    con = Console()
    con.print(t)
    for line in notes(rows, header):
        con.print(line, markup=False, highlight=False)
