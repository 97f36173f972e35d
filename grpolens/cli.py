"""The ``grpolens`` command line.

Each command lives in ``grpolens/commands/<name>.py`` and registers itself through ``register(app)``;
the list below is the only place that names them. Command modules import only light modules at
import time (typer, pathlib): ``grpolens --help`` must not pay for polars, torch, dash or plotly.
"""

from __future__ import annotations

import os
import signal
import sys


def _exit_interrupted(signum=None, frame=None) -> None:
    """Ctrl-C where no command runs (imports at start, the interpreter's shutdown): exit 130 at once
    with one line. Nothing is being written then, and Python would otherwise print a traceback of
    the import under way, or an ``Exception ignored ... KeyboardInterrupt`` fragment at shutdown."""
    os.write(2, b"error: interrupted\n")
    os._exit(130)


# The program itself (`grpolens`, `python -m grpolens.cli`), not a library importing the module:
# from here on until main() runs a command, Ctrl-C is one line and exit 130.
_PROGRAM = __name__ == "__main__" or os.path.basename(sys.argv[0] if sys.argv else "") == "grpolens"
if _PROGRAM and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _exit_interrupted)

import importlib  # noqa: E402  (after the handler: an import can take a second)
from typing import Optional  # noqa: E402

import typer  # noqa: E402

#: Every command module, in the order ``--help`` lists them. A test checks each one is documented.
COMMAND_MODULES = [
    "validate",
    "synth",
    "recompute",
    "parity",
    "metrics",
    "tokens",
    "completions",
    "explain",
    "sidecars",
    "check",
    "doctor",
    "serve",
    "sweep",
    "import_",
    "export",
]

app = typer.Typer(
    name="grpolens",
    help="Token-level offline analysis of GRPO-family RL training runs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
)


def _print_version(value: bool) -> None:
    if value:
        from grpolens import __version__

        print(f"grpolens {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", "-V", callback=_print_version, is_eager=True,
                                 help="Print the grpolens version and exit."),
    invalid_utf8: Optional[str] = typer.Option(
        None, "--invalid-utf8", metavar="refuse|replace",
        help="Text (prompt, completion) that is not valid UTF-8: 'refuse' the file (the default; "
             "the error names file, column and row) or 'replace' the bad bytes with U+FFFD. "
             "Environment: GRPOLENS_INVALID_UTF8."),
) -> None:
    """Token-level offline analysis of GRPO-family RL training runs."""
    if invalid_utf8 is not None:
        if invalid_utf8 not in ("refuse", "replace"):
            from grpolens.errors import UserError

            raise UserError(f"--invalid-utf8: {invalid_utf8!r} is not one of refuse, replace")
        os.environ["GRPOLENS_INVALID_UTF8"] = invalid_utf8  # read by grpolens.text_columns, here and in workers


for _name in COMMAND_MODULES:
    importlib.import_module(f"grpolens.commands.{_name}").register(app)


def command():
    """The click command behind ``app``, with help that names what a value means, not its type.

    typer shows an argument as ``{run}`` and a value as ``<int>``/``<path>``/``<list[str]>``;
    here an option's value is named after the option (``--step STEP``, ``--set SET``) and an
    argument by its name in capitals (``RUN``), unless the command gave a metavar of its own.
    """
    import typer.main

    group = typer.main.get_command(app)
    for cmd in [group, *group.commands.values()]:
        for p in cmd.params:
            if getattr(p, "metavar", None) is None and not getattr(p, "is_flag", False):
                p.metavar = p.name.upper().rstrip("_")
            if p.param_type_name == "argument":  # click's own spelling: RUN, [PATHS]...
                shown = (p.metavar if p.required else f"[{p.metavar}]") + ("..." if p.nargs != 1 else "")
                p._usage_display_name = lambda shown=shown: shown
                p.display_type_rich = lambda ctx: None
    return group


def _print_error(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}")


def _os_error_line(e: OSError) -> str:
    # os.replace(tmp, target) names both; the target is the path the user knows
    path = e.filename2 if e.filename2 is not None else e.filename
    reason = e.strerror or str(e)
    return f"{path}: {reason}" if path is not None else reason


def _interrupts_unsaid(hook):
    """``hook`` for everything but a KeyboardInterrupt raised where Python can only print it: in a
    clean-up that runs while a Ctrl-C unwinds the command (a generator closed, an object finalised;
    about 1 in 10 Ctrl-Cs into a recompute met one). The command is already on its way to
    ``error: interrupted``: a traceback there says nothing more."""

    def unraisable(u) -> None:
        if not isinstance(u.exc_value, KeyboardInterrupt):
            hook(u)

    return unraisable


def main(argv: list[str] | None = None) -> None:
    """Console entry point: runs the app, turning user errors into one line and an exit code."""
    from grpolens.allocator import keep_freed_memory

    keep_freed_memory()  # a command-line process reuses the memory it frees (see grpolens/allocator.py)
    if _PROGRAM:  # the program, not a caller in its own process: commands that read runs may skip pandas
        from grpolens.run import no_pandas

        no_pandas.PROGRAM = True
    quiet = signal.getsignal(signal.SIGINT) is _exit_interrupted
    if quiet:  # a command is running: Ctrl-C raises KeyboardInterrupt, so that it cleans up on its way out
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.unraisablehook = _interrupts_unsaid(sys.unraisablehook)  # for the rest of the process
    try:
        _run(argv)
    finally:
        if quiet:  # the interpreter's shutdown (joining threads, atexit) is no place for a traceback
            signal.signal(signal.SIGINT, _exit_interrupted)


def _run(argv: list[str] | None) -> None:
    from grpolens.errors import RunFormatError, UserError

    try:
        # In non-standalone mode click *returns* the exit code of a command that raised
        # typer.Exit(code) instead of exiting with it.
        rc = command().main(args=argv, prog_name="grpolens", standalone_mode=False)
        if rc == 130:  # typer turns a KeyboardInterrupt in a command into a silent exit 130
            _print_error("interrupted")
        if isinstance(rc, int) and rc != 0:
            sys.exit(rc)
    except UserError as e:
        _print_error(e.message)
        sys.exit(e.exit_code)
    except RunFormatError as e:
        _print_error(str(e))
        sys.exit(2)
    except OSError as e:
        # The file system refused: an output path that is a directory or lies below a file, a disk
        # that is full or read-only, no permission. The path and the reason, not a traceback; outputs
        # are written atomically, so nothing is left half-written. (A closed pipe on stdout, EPIPE,
        # never gets here: click's main exits 1 quietly on it.)
        _print_error(_os_error_line(e))
        sys.exit(2)
    except typer.Exit as e:  # raised by commands to set their exit code
        sys.exit(e.exit_code)
    except typer.Abort:
        _print_error("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        _print_error("interrupted")
        sys.exit(130)
    except RecursionError:
        # a JSON, TOML or YAML input nested thousands deep that no reader of it named
        _print_error("an input is nested too deeply to read (a JSON, TOML or YAML file of the run or an option)")
        sys.exit(2)
    except Exception as e:
        # Usage errors (unknown command or option, bad value) are click exceptions; typer ships
        # its own copy of click, so they are recognised by their interface, not their class.
        if callable(getattr(e, "show", None)) and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            sys.exit(e.exit_code)
        raise

if __name__ == "__main__":  # pragma: no cover
    main()
