"""Benchmarks write their figures into the docs themselves, between two markers::

    <!-- NAME: begin (written by benchmarks/SCRIPT.py --write-doc) -->
    Measured 2026-11-23 19:47 UTC on <machine>, with `<command>` (load average at the end 2.1):
    ...
    <!-- NAME: end -->

so that a figure in a doc is the output of the command printed beside it, with the machine and the
date, and is replaced whole by the next run. ``tests/test_doc_timings.py`` refuses timing figures
outside such blocks.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    """CPU model, cores, memory, OS and Python: enough to compare two measurements."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return f"{cpu}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def markers(name: str, script: str, flag: str = "--write-doc") -> tuple[str, str]:
    return f"<!-- {name}: begin (written by {script} {flag}) -->", f"<!-- {name}: end -->"


def shown_command(script: str, argv: list[str], private: tuple[str, ...] = ("--dir", "--run")) -> str:
    """The command as a reader would type it: without the write flag and this machine's paths."""
    shown, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.startswith("--write-") or a == "--keep" or any(a.startswith(p + "=") for p in private):
            continue
        if a in private:
            skip = True
            continue
        shown.append(a)
    return " ".join(["python", script, *shown])


def header(command: str, started: dt.datetime) -> str:
    return (f"Measured {started:%Y-%m-%d %H:%M} UTC on {machine()}, with `{command}` "
            f"(load average at the end {os.getloadavg()[0]:.1f}):")


def write_block(page: str | Path, name: str, script: str, text: str, flag: str = "--write-doc",
                after: str | None = None) -> None:
    """Replace the block NAME in PAGE by TEXT (atomically); a page without it gets it after the
    line AFTER, and without that the script stops with one line."""
    path = ROOT / page
    begin, end = markers(name, script, flag)
    doc = path.read_text(encoding="utf-8")
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in doc:
        head, rest = doc.split(begin, 1)
        if end not in rest:
            sys.exit(f"{page}: '{begin}' has no '{end}'")
        doc = head + block + rest.split(end, 1)[1]
    elif after is not None and after in doc:
        head, rest = doc.split(after, 1)
        doc = head + after + "\n" + block + "\n" + rest
    else:
        sys.exit(f"{page} has no block '{begin}' to replace")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(doc, encoding="utf-8")
    tmp.replace(path)


def upsert_row(page: str | Path, name: str, script: str, intro: str, columns: list[str], key: str,
               cells: list[str]) -> None:
    """Tables where each row is one run of the script (its command is the row's first cell): the
    row with the same command is replaced, a new command is appended; the block is rewritten."""
    path = ROOT / page
    begin, end = markers(name, script)
    doc = path.read_text(encoding="utf-8")
    rows: list[str] = []
    if begin in doc:
        inside = doc.split(begin, 1)[1].split(end, 1)[0]
        rows = [ln for ln in inside.splitlines() if ln.startswith("| `python ")]
    row = "| " + " | ".join([f"`{key}`", *cells]) + " |"
    rows = [r for r in rows if not r.startswith(f"| `{key}` |")] + [row]
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows]
    write_block(page, name, script, intro + "\n\n" + "\n".join(table))


def measured_cell(started: dt.datetime) -> str:
    return f"{started:%Y-%m-%d %H:%M} UTC, {machine()}, load {os.getloadavg()[0]:.1f}"
