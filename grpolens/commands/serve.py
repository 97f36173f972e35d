"""``grpolens serve [RUN_OR_DIR ...]``: the dashboard."""

from __future__ import annotations

from typing import List, Optional

import typer

from grpolens.commands.storage_option import STORAGE_OPTION, refuse_unless_remote


def serve_cmd(
    paths: List[str] = typer.Argument(None, help="Runs, directories holding runs (searched 3 levels deep), or s3://bucket/prefix runs. [default: .]"),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on. Anything but loopback exposes the runs' texts to the network."),
    allow_host: List[str] = typer.Option([], "--allow-host", metavar="NAME", help="Also answer requests addressed to NAME (repeatable), e.g. the name a reverse proxy forwards; '*' answers any (the proxy checks names). Otherwise only requests for the address listened on are answered (a defence against DNS rebinding)."),
    port: int = typer.Option(8050, "--port", help="TCP port."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="A run drawn dashed on every curve, for comparison (a directory or s3://...)."),
    watch: bool = typer.Option(False, "--watch", help="Pick up new steps of runs that are still training: a local run is looked at every 5 s, an s3:// run listed every 15 s (3 LIST requests when idle), and recomputed when it changed."),
    no_recompute: bool = typer.Option(False, "--no-recompute", help="Serve the metrics as they are; do not recompute missing or stale ones first."),
    debug: bool = typer.Option(False, "--debug", help="Dash debug mode (reloader and error pop-ups; for development)."),
    storage_option: List[str] = STORAGE_OPTION,
) -> None:
    """Serve the dashboard: curves of every metric, and the tokens behind each step.

    Recomputes missing or stale metrics first (incremental: cheap when up to date). The server
    reads only the runs named here.
    """
    refuse_unless_remote(storage_option, {"PATHS": paths or ["."], "--baseline": baseline})
    from rich.console import Console

    from grpolens.errors import UserError
    from grpolens.serve import hosts
    from grpolens.serve.runs import resolve_runs

    console = Console(stderr=True)
    if not 0 < port < 65536:
        raise UserError(f"--port must be in 1..65535, got {port}")
    for name in allow_host:
        hosts.check_allow_host(name)
    runs = resolve_runs(paths or ["."], baseline)
    # With --debug, werkzeug's reloader runs this command twice: the first process holds the port
    # and restarts the second, which serves, whenever a source file changes. The port check, the
    # recompute and the messages belong to the first; the watcher to the one that serves.
    child = _reloader_child()
    if not child:
        _check_port(host, port)
        if not no_recompute:
            _recompute_all(runs, console)
    if watch and (child or not debug):
        _start_watcher(runs, console)
    if not child and not hosts.is_loopback(host):
        console.print(f"[yellow]warning:[/] serving on {host}: anyone who can reach it sees these runs' prompts and "
                      "completions", highlight=False)

    from grpolens.serve.app import create_app

    app = create_app(runs, watch=watch, host=host, allow_hosts=allow_host)
    shown = "localhost" if host in hosts.WILDCARD_BINDS else f"[{host}]" if ":" in host else host
    if not child:
        console.print(f"serving {len(runs.names)} run(s) at http://{shown}:{port}/  (Ctrl-C stops)", highlight=False)
    app.run(host=host, port=port, debug=debug, use_reloader=debug)


def _reloader_child() -> bool:
    """Whether this process is the one werkzeug's reloader started (``--debug``)."""
    from werkzeug.serving import is_running_from_reloader

    return is_running_from_reloader()


def _check_port(host: str, port: int) -> None:
    """Fail now, with one line, when the address cannot be listened on (before any recompute)."""
    import socket

    from grpolens.errors import UserError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise UserError(f"--host {host}: {e}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind(addr)
        except OSError as e:
            raise UserError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); "
                            "is another server running there? pick another --port") from None


def _recompute_all(runs, console) -> None:
    from grpolens.analysis.recompute import recompute
    from grpolens.commands.ui import progress_bar

    for name, path in runs.runs.items():
        with progress_bar(console, f"recompute {name}") as tick:
            res = recompute(path, write=True, progress=tick, result=True)
        if res.computed_steps:
            console.print(f"{name}: {len(res.computed_steps)} step(s) computed, {len(res.reused_steps)} up to date",
                          highlight=False)


def _start_watcher(runs, console) -> None:
    """Recompute, on a daemon thread, any run whose shards change (grpolens/serve/watch.py)."""
    from grpolens.serve.watch import Watcher

    def report(name: str, e: Exception) -> None:
        console.print(f"[yellow]watch:[/] {name}: {e}", highlight=False, markup=True)

    Watcher(runs.runs, report).start()


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_cmd)
