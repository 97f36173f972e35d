"""Every shell and Python snippet in README.md, docs/ and sample_runs/README.md runs, and prints what the page shows.

A fenced block is a *snippet* when its language is a shell (``bash``, ``sh``, ``shell``,
``console``) or Python. Each one is, in this order:

* a file under ``docs/examples/``, shown verbatim (``docs/cli.md`` shows each ``<command>.sh``):
  ``tests/test_docs_examples.py`` runs those, and checks each Python example's ``.out``;
* or run here, command by command, in a scratch directory holding ``sample_runs/``,
  ``docs/examples/`` and the inputs its page names (``PREPARE``); each command must exit 0 unless
  its comment says ``exit N``, and where a ``console`` block shows output after a ``$`` line the
  command's output must be exactly that (a line ``...`` stands for any number of lines);
* except the commands the page itself marks as not run, each with its reason, by a comment line
  directly above the block (one per command; a Python snippet is named by its first line)::

      <!-- not run: `grpolens serve RUN`: starts a server until stopped -->

  Every command of the block that starts with the quoted text is left out. The marker sits in the
  page, beside the command, so that whoever edits the block sees that no test runs it and why.

A new snippet or command that is none of these fails ``test_every_snippet_is_run_or_marked``; a
marker that names no command of its block, or stands above no block, fails too, and so does an
entry of ``PREPARE`` that no longer names a page with snippets."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tests.sample_runs import copy_sample_runs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"
#: the pages whose snippets and commands are checked
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "sample_runs" / "README.md"]
SHELLS = {"bash", "sh", "shell", "console"}
PYTHONS = {"python", "py", "pycon"}

#: what a page's snippets expect to find in the directory they run in (run with bash, before)
PREPARE = {
    "README.md": "cp -r sample_runs/trl-tiny RUN && grpolens check RUN --write-golden golden.json -q",
    "docs/profiles.md": "cp -r sample_runs/trl-tiny RUN",
    "docs/integrations/trl.md": "mkdir -p runs && cp -r sample_runs/trl-tiny runs/my-run",
    "docs/export.md": "cp -r sample_runs/trl-tiny RUN",
    "docs/sidecars.md": "cp -r {demo} demo",
}

#: environment a page's snippets assume (GitHub Actions sets GITHUB_STEP_SUMMARY in a job)
ENV = {"docs/check.md": {"GITHUB_STEP_SUMMARY": "step-summary.md"}}

#: pages whose snippets run in a few seconds; the others run several commands each (10-70 s on a
#: loaded 2-core machine) and are marked slow
QUICK_PAGES = {"docs/run-format.md", "sample_runs/README.md"}


@dataclass
class Command:
    text: str                      # as shown, continuation lines joined
    output: list[str] = field(default_factory=list)  # the lines a console block shows after it
    shows_output: bool = False


@dataclass
class Snippet:
    page: str
    line: int
    lang: str
    body: str
    not_run: dict[str, str] = field(default_factory=dict)  # marked above the block: prefix -> why

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


#: a fenced block, at the margin or indented inside a list item: (indent, language, body)
FENCED = re.compile(r"^( {0,4})```([\w-]*)[^\n]*\n(.*?)^\1```", re.M | re.S)
#: the marker of a command not run, on its own line(s) directly above the block
MARKER = re.compile(r"^ {0,4}<!-- not run: `([^`]+)`: (.*?) -->[ \t]*\n", re.M | re.S)


def _marker_chain(text: str, start: int) -> list[re.Match]:
    """The not-run markers on the lines directly above offset ``start`` (a block's fence)."""
    chain, end = [], start
    while (m := next((m for m in MARKER.finditer(text, 0, end) if m.end() == end), None)) is not None:
        chain.append(m)
        end = m.start()
    return chain


def markers_above(text: str, start: int) -> dict[str, str]:
    return {m.group(1): " ".join(m.group(2).split()) for m in _marker_chain(text, start)}


def orphan_markers() -> list[str]:
    """Markers that stand directly above no fenced block."""
    out = []
    for path in PAGES:
        text = path.read_text(encoding="utf-8")
        attached = {m.start() for f in FENCED.finditer(text) for m in _marker_chain(text, f.start())}
        out += [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)}"
                for m in MARKER.finditer(text) if m.start() not in attached]
    return out


def snippets() -> list[Snippet]:
    found = []
    for path in PAGES:
        text = path.read_text(encoding="utf-8")
        for m in FENCED.finditer(text):
            lang = m.group(2).lower()
            if lang in SHELLS | PYTHONS:
                body = re.sub(rf"^{m.group(1)}", "", m.group(3), flags=re.M)  # a block inside a list item
                found.append(Snippet(str(path.relative_to(ROOT)), text.count("\n", 0, m.start()) + 1, lang, body,
                                     markers_above(text, m.start())))
    return found


def untagged_blocks() -> list[str]:
    out = []
    for path in PAGES:
        text = path.read_text(encoding="utf-8")
        for m in FENCED.finditer(text):
            if not m.group(2):
                out.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}")
    return out


def example_shown(snippet: Snippet) -> Path | None:
    """The docs/examples file this snippet shows verbatim, if any."""
    for f in sorted(EXAMPLES.iterdir()):
        if f.suffix in (".sh", ".py") and f.read_text(encoding="utf-8").strip() == snippet.body.strip():
            return f
    return None


def commands(snippet: Snippet) -> list[Command]:
    """The commands of a shell snippet; ``a && b`` is two commands, ``\\`` continues a line."""
    lines = snippet.body.splitlines()
    cmds: list[Command] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if snippet.lang == "console" and not line.startswith("$ "):
            if not cmds:
                raise AssertionError(f"{snippet.id}: output before any `$` line")
            cmds[-1].output.append(line)
            cmds[-1].shows_output = True
            i += 1
            continue
        if snippet.lang == "console":
            line = line[2:]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        if heredoc := re.search(r"<<-?\s*'?(\w+)'?", line):  # the here-document is part of the command
            while i + 1 < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
                line += "\n" + lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        code = line.split(" #", 1)[0] if " #" in line else line
        parts = [p.strip() for p in code.split(" && ")]
        comment = line[len(code):]
        for k, part in enumerate(parts):
            cmds.append(Command(part + (comment if k == len(parts) - 1 else "")))
    return cmds


def not_run_reason(snippet: Snippet, command: str) -> str | None:
    return next((why for start, why in snippet.not_run.items() if command.startswith(start)), None)


def is_python_not_run(snippet: Snippet) -> str | None:
    first = next((ln for ln in snippet.body.splitlines() if ln.strip()), "")
    return not_run_reason(snippet, first)


def expected_status(command: str) -> int:
    comment = command.split(" #", 1)[1] if " #" in command else ""
    m = re.search(r"\bexit (\d+)\b(?! if)", comment)  # "(exit 1 if not)" describes, it does not expect
    return int(m.group(1)) if m else 0


TIMING = re.compile(r"\b\d+(?:\.\d+)?\s?(?:s|ms)\b")


def normalise(text: str, scratch: Path) -> str:
    text = text.replace(str(scratch) + os.sep, "").replace(str(scratch), ".")
    return TIMING.sub("<time>", text)


def matches(shown: list[str], printed: str) -> bool:
    """Exact line-for-line match of the shown output; a line ``...`` stands for any lines."""
    pattern = "".join(r"(?:[^\n]*\n)*?" if ln.strip() == "..." else re.escape(ln.rstrip()) + r"\n"
                      for ln in shown)
    body = "".join(ln.rstrip() + "\n" for ln in printed.splitlines())
    return re.fullmatch(pattern, body) is not None


def _params():
    out = []
    for s in snippets():
        if s.lang in SHELLS and example_shown(s) is None and any(
                not not_run_reason(s, c.text) for c in commands(s)):
            marks = [] if s.page in QUICK_PAGES else [pytest.mark.slow]
            out.append(pytest.param(s, id=s.id, marks=marks))
    return out


def test_every_snippet_is_run_or_marked():
    unaccounted, stale = [], []
    for s in snippets():
        if example_shown(s) is not None:
            stale += [f"{s.id}: {start} (the block is a docs/examples file, which is run)" for start in s.not_run]
            continue
        if s.lang in PYTHONS:
            if is_python_not_run(s) is None:
                unaccounted.append(f"{s.id}: a Python snippet that is no docs/examples/*.py file and is not marked")
            shown = [next((ln for ln in s.body.splitlines() if ln.strip()), "")]
        else:
            shown = [c.text for c in commands(s)]
        stale += [f"{s.id}: {start}" for start in s.not_run if not any(c.startswith(start) for c in shown)]
    assert not unaccounted, unaccounted
    assert not stale, f"not-run markers that name no command of their block: {stale}"
    assert not orphan_markers(), f"not-run markers above no block: {orphan_markers()}"
    pages = {s.page for s in snippets()}
    for name, table in (("PREPARE", PREPARE), ("ENV", ENV), ("QUICK_PAGES", QUICK_PAGES)):
        assert not set(table) - pages, f"{name} names pages without snippets: {set(table) - pages}"


def test_markers_are_read_from_above_the_block():
    text = ("Intro:\n\n<!-- not run: `grpolens serve RUN`: starts a\n  server -->\n<!-- not run: `curl `: asks it -->\n"
            "```bash\ngrpolens serve RUN\n```\n\n<!-- not run: `x`: far -->\n\ntext\n```bash\nx\n```\n")
    blocks = list(FENCED.finditer(text))
    assert markers_above(text, blocks[0].start()) == {"grpolens serve RUN": "starts a server", "curl ": "asks it"}
    assert markers_above(text, blocks[1].start()) == {}
    page = ROOT / "docs" / "__probe__.md"
    try:
        page.write_text(text)
        PAGES.append(page)
        assert orphan_markers() == ["docs/__probe__.md:10: x"]
    finally:
        PAGES.remove(page)
        page.unlink()


def inline_commands() -> list[tuple[str, str]]:
    """(page, command) for every code span in prose that starts with ``grpolens ``."""
    out = []
    for path in PAGES:
        text = re.sub(r"^(```|~~~).*?^\1", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
        out += [(str(path.relative_to(ROOT)), m.group(1)) for m in re.finditer(r"`(grpolens [^`\n]+)`", text)]
    return out


#: placeholders of a synopsis, not words of the command line
SYNOPSIS = re.compile(r"\[[^\]]*\]|(?<!\S)(?:\.\.\.|…)(?!\S)")


def command_line_problem(code: str) -> str | None:
    """What is wrong with a ``grpolens ...`` line as the CLI would parse it: no such command, no
    such option, or more arguments than the command takes. A fragment (``--only`` without its
    value, a command without its RUN) is fine: the docs name options in passing."""
    import shlex

    from grpolens.cli import command

    code = code.replace("\\|", "|")  # a pipe in a table cell is written \|
    code = re.split(r"\s[>|]\s", SYNOPSIS.sub(" ", code), maxsplit=1)[0]
    try:
        words = shlex.split(code)
    except ValueError:
        words = code.split()
    cmd, rest, ctx = command(), words[1:], None
    while hasattr(cmd, "commands"):
        ctx = type(cmd.context_class(cmd))(cmd, info_name=cmd.name, parent=ctx)
        parsed, rest, _ = cmd.make_parser(ctx).parse_args(rest) if rest and rest[0].startswith("-") \
            else ({}, rest, None)
        if not rest or rest[0] == "COMMAND":
            return None
        sub = cmd.commands.get(rest[0])
        if sub is None:
            return f"no command {rest[0]!r}"
        cmd, rest = sub, rest[1:]
    ctx = type(cmd.context_class(cmd))(cmd, info_name=cmd.name, parent=ctx)
    try:
        _, args, _ = cmd.make_parser(ctx).parse_args(rest)
    except Exception as e:  # noqa: BLE001 - the CLI's own parser, vendored by typer
        if "requires an argument" in str(e) or "requires" in str(e) and "argument" in str(e):
            return None  # an option named without its value
        return f"{cmd.name}: {e}"
    # the parser gives each argument its words; what is left over, click refuses
    return f"{cmd.name}: unexpected extra argument(s) {args}" if args else None


def test_every_grpolens_command_shown_parses():
    """Fast, and for the commands that are not run too: each ``grpolens ...`` line of a snippet and
    each one in a code span of the prose names a real command, real options and no more arguments
    than the command takes (``grpolens metrics entropy`` fails: ``--family entropy``)."""
    wrong = []
    for s in snippets():
        if s.lang not in SHELLS:
            continue
        for c in commands(s):
            code = c.text.split(" #", 1)[0]
            if code.split()[:1] == ["grpolens"] and (why := command_line_problem(code)):
                wrong.append(f"{s.id}: `{code}`: {why}")
    for page, code in inline_commands():
        if why := command_line_problem(code):
            wrong.append(f"{page}: `{code}`: {why}")
    assert not wrong, "\n".join(wrong)


def test_command_line_problem():
    assert command_line_problem("grpolens metrics entropy")
    assert command_line_problem("grpolens metrics --nope")
    assert command_line_problem("grpolens nope RUN")
    assert command_line_problem("grpolens validate RUN more")
    for fine in ("grpolens metrics --family entropy", "grpolens recompute --only", "grpolens serve RUN [RUN ...]",
                 "grpolens tokens RUN --step N --by …", "grpolens metrics --markdown > docs/metrics.md",
                 "grpolens [GLOBAL OPTIONS] COMMAND ...", "grpolens --version", "grpolens check",
                 "grpolens tokens ... \\| head"):
        assert command_line_problem(fine) is None, fine


def test_every_code_block_says_its_language():
    # an untagged block would hide a shell snippet from the tests above
    assert not untagged_blocks(), f"tag these blocks (```text for listings): {untagged_blocks()}"


def test_snippet_parsing():
    s = Snippet("docs/x.md", 1, "console", "$ a --x \\\n    --y  # exit 1\nout 1\n...\nout 2\n$ b && c # note\n")
    cs = commands(s)
    assert [c.text for c in cs] == ["a --x  --y # exit 1", "b", "c # note"]
    assert cs[0].output == ["out 1", "...", "out 2"] and not cs[1].shows_output
    assert expected_status(cs[0].text) == 1 and expected_status(cs[2].text) == 0
    assert expected_status("grpolens parity R  # reproduced? (exit 1 if not)") == 0
    assert matches(cs[0].output, "out 1\nmore\nmore\nout 2\n")
    assert matches(cs[0].output, "out 1\nout 2\n")
    assert not matches(cs[0].output, "out 1\nout 2\nextra\n")
    assert not matches(["only"], "only\nand more\n")
    assert normalise("/x/s/a in 1.93s, 208 ms", Path("/x/s")) == "a in <time>, <time>"
    here = Snippet("docs/x.md", 1, "bash", "python - <<'PY'\nimport os # x\nPY\nb\n")
    assert [c.text for c in commands(here)] == ["python - <<'PY'\nimport os # x\nPY", "b"]


@pytest.fixture(scope="session")
def synthetic_demo(tmp_path_factory) -> Path:
    """One small synthetic run with texts, shared by the snippets that name `demo`."""
    d = tmp_path_factory.mktemp("doc-snippets") / "demo"
    r = subprocess.run([sys.executable, "-m", "grpolens.cli", "synth", str(d), "--steps", "4", "--ranks", "2",
                        "--max-len", "64", "--texts", "--seed", "1"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    return d


@pytest.mark.parametrize("snippet", _params())
def test_shell_snippet_runs_and_prints_what_it_shows(snippet, tmp_path, synthetic_demo):
    scratch = tmp_path / "work"
    scratch.mkdir()
    copy_sample_runs(scratch / "sample_runs")
    shutil.copytree(EXAMPLES, scratch / "docs" / "examples")
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "grpolens").write_text(f"#!/bin/sh\nexec {sys.executable} -m grpolens.cli \"$@\"\n")
    (shim / "grpolens").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "GRPOLENS_REPO": str(ROOT), "COLUMNS": "120", "WANDB_SILENT": "true"}
    env.update(ENV.get(snippet.page, {}))
    if snippet.page in PREPARE:
        r = subprocess.run(["bash", "-ec", PREPARE[snippet.page].format(demo=synthetic_demo)], cwd=scratch,
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    for c in commands(snippet):
        if not_run_reason(snippet, c.text):
            continue
        r = subprocess.run(["bash", "-c", c.text], cwd=scratch, env=env, capture_output=True, text=True,
                           timeout=300)
        printed = r.stdout + r.stderr
        assert r.returncode == expected_status(c.text), \
            f"{snippet.id}: `{c.text}` exited {r.returncode}:\n{printed[-3000:]}"
        if c.shows_output:
            shown = [normalise(ln, scratch) for ln in c.output]
            assert matches(shown, normalise(printed, scratch)), \
                f"{snippet.id}: `{c.text}` printed\n{printed}\nbut the page shows\n" + "\n".join(c.output)
