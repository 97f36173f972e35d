"""Recompute's steps on worker processes: the per-step work scales with the cores.

Threads do not: the per-step work is mostly Python calling numpy and polars in small pieces, and
a second thread mostly waits for the interpreter lock. So a recompute with enough to do computes
its steps with ``N`` workers (``recompute --workers N``, ``GRPOLENS_WORKERS``; default the CPU
count, at most :data:`MAX_DEFAULT_WORKERS`): this process and ``N - 1`` worker processes. Each
runs the *whole* per-step body (:class:`grpolens.analysis.recompute.StepWork`) for the steps it
is given: it reads the step's shards, runs the visitors, reduces every metric and makes the
step's rows of the step tables (completions, top tokens, IS histograms); a worker process sends
back the step's row of metrics, the token columns present and those table rows (a few hundred
rows a table), which this process puts in the recompute's spill as it does its own steps' (held
in memory up to :data:`grpolens.run.step_table.HOLD_BYTES`, then in files): a worker writes no
file, and no step's rows are written by one process to be read back by another. This process
merges the rows (keyed by step, sorted at the end: the output is the one the serial path writes,
value for value) and writes every output file.

Dispatch keeps memory bounded: a worker holds one step's data at a time and has at most
:data:`IN_FLIGHT` steps queued; steps go out in step order to whichever worker has room. This
process computes steps from the start, so the workers' start (a fresh interpreter importing
grpolens: about a second of CPU) costs little wall time; a worker gets steps once it is ready.

Workers are fresh interpreters (``subprocess``), not forks: this process may have started
polars' and numpy's thread pools, which a forked child inherits in an unusable state; and
unlike ``multiprocessing``'s spawn they do not run the caller's main module again (a script
calling :func:`grpolens.recompute` without an ``if __name__ == "__main__"`` guard is safe). Each
loads the plugins (:func:`grpolens.plugins.load_plugins`) with this process's ``sys.path``; a
metric registered here at run time (not by a plugin) is unknown to it: it declines and the
steps are computed here.

An error in a worker process (a corrupt shard: :class:`~grpolens.errors.RunFormatError`; a
:class:`~grpolens.errors.UserError`) is raised here as the same exception; the workers are
stopped (also on Ctrl-C, which they ignore themselves: this process stops them) and the caller
removes the spill, as for an error here.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections import deque
from typing import Any, Callable, Iterator

from grpolens.errors import UserError, env_int

#: the default number of workers is the CPU count, at most this
MAX_DEFAULT_WORKERS = 8
#: a worker is started only for at least this many steps to compute ...
MIN_STEPS_PER_WORKER = 2
#: ... and this many bytes of their shards (a worker's start, its imports, costs about a second
#: of CPU: a few MB of shards take that long to compute)
MIN_BYTES_PER_WORKER = 16 << 20
#: whether this process computes steps too (its share while the workers start, and then as one
#: of the ``N``); the tests turn it off to put every step through the worker processes
COMPUTE_HERE = True
#: steps queued per worker: one computing, one ready to start (memory: one step's data per worker)
IN_FLIGHT = 2


#: (step, row of metrics, token columns present or None, table name -> the step's rows of it)
Result = tuple[int, dict[str, Any], "set[str] | None", dict]


def default_workers() -> int:
    """``GRPOLENS_WORKERS``, else the CPUs this process may use (at most :data:`MAX_DEFAULT_WORKERS`)."""
    n = env_int("GRPOLENS_WORKERS")
    if n is not None:
        return n
    try:
        cpus = len(os.sched_getaffinity(0))  # the CPUs this process may run on (a container's, a taskset's)
    except AttributeError:  # macOS
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_WORKERS, cpus))


def count(workers: int | None, n_steps: int, n_bytes: int) -> int:
    """How many workers ``n_steps`` steps of ``n_bytes`` of shards get: ``workers`` (default
    :func:`default_workers`), fewer so that each has at least :data:`MIN_STEPS_PER_WORKER` steps
    and :data:`MIN_BYTES_PER_WORKER` bytes; 1 means this process alone."""
    n = default_workers() if workers is None else workers
    if n < 1:
        raise UserError(f"--workers: expected a whole number >= 1, got {n}")
    n = min(n, n_steps // max(MIN_STEPS_PER_WORKER, 1))
    if MIN_BYTES_PER_WORKER > 0:
        n = min(n, n_bytes // MIN_BYTES_PER_WORKER)
    return max(1, n)


def map_steps(spec, steps: list[int], n: int,
              here: Callable[[int], tuple[dict[str, Any], set[str] | None]]) -> Iterator[Result]:
    """Compute ``steps`` with ``n`` workers: this process (``here(step)``, between dispatching)
    and ``n - 1`` worker processes built from ``spec``. Yields ``(step, row, present, spilled)``
    as each step is done (``present``: the step's token columns, None for a step without token
    shards; ``spilled``: table name -> the step's rows of that table from a worker process, for
    the caller's spill; empty for a step computed here, whose rows ``here`` put in the spill itself).

    This process computes from the start, so the workers' start-up (their imports) costs no wall
    time; a worker gets steps once it is ready. Workers that cannot compute ``spec``'s steps
    (e.g. a metric they do not know) decline, and the steps are computed here. Any error of a
    worker is raised here as the worker raised it."""
    from multiprocessing.connection import wait

    queue = deque(steps)
    workers: list[_Worker] = []
    try:
        payload = pickle.dumps((sys.path, spec))
    except Exception:  # noqa: BLE001 - e.g. a config value that does not pickle: all steps here
        n = 1
    try:
        for _ in range(n - 1):
            try:
                workers.append(_Worker.start(payload))
            except (OSError, ValueError):  # no processes to be had (a limit, a platform without pass_fds): here
                break
        while queue or any(w.steps for w in workers):
            for w in workers:  # the workers that are ready get steps, up to IN_FLIGHT each
                while w.ready and queue and len(w.steps) < IN_FLIGHT:
                    try:
                        w.conn.send(queue[0])
                    except (BrokenPipeError, ConnectionResetError):
                        # it ended after sending its error (still unread): that error, not a broken
                        # pipe (an EPIPE OSError the command line would turn into a silent exit 1)
                        raise w.last_word() from None
                    w.steps.append(queue.popleft())
            listen = {w.conn: w for w in workers if not w.declined and (not w.ready or w.steps)}
            here_now = bool(queue) and (COMPUTE_HERE or all(w.declined for w in workers))
            for c in wait(list(listen), timeout=0 if here_now else None) if listen else ():
                w = listen[c]
                try:
                    kind, *msg = c.recv()
                except EOFError:
                    raise w.last_word() from None
                if kind == "ready":
                    w.ready = True
                elif kind == "unavailable":  # this process computes the steps
                    w.declined = True
                elif kind == "error":
                    raise _rebuilt(*msg)
                else:
                    w.steps.popleft()
                    yield tuple(msg)
            if here_now:
                step = queue.popleft()
                row, present = here(step)
                yield step, row, present, {}
        for w in workers:
            w.stop()
    finally:
        for w in workers:
            w.kill()


class _Worker:
    """A worker process and this end of its pipe."""

    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn
        self.ready = self.declined = False
        self.steps: deque[int] = deque()  # sent, not yet done

    @classmethod
    def start(cls, payload: bytes) -> "_Worker":
        """A fresh interpreter running :func:`_serve` (not ``fork``: this process may have
        started polars' and numpy's thread pools, which a forked child would inherit broken)."""
        import socket
        import subprocess
        from multiprocessing.connection import Connection

        import grpolens

        mine, theirs = socket.socketpair()
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(grpolens.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        code = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\n"  # Ctrl-C: the parent stops us
                f"from grpolens.analysis.step_workers import _serve; _serve({theirs.fileno()})")
        try:
            # a session of its own: a terminal's Ctrl-C goes to the parent alone, even before the
            # line above runs (a worker starting then died with a KeyboardInterrupt traceback)
            proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        conn = Connection(mine.detach())
        conn.send_bytes(payload)
        return cls(proc, conn)

    def last_word(self) -> BaseException:
        """What to raise for a worker whose pipe closed: the error it sent before it ended (read
        from what is left in the pipe), else that it ended unexpectedly, with its exit code."""
        try:
            while self.conn.poll():
                kind, *msg = self.conn.recv()
                if kind == "error":
                    return _rebuilt(*msg)
        except (EOFError, OSError):
            pass
        return RuntimeError(f"a recompute worker process ended unexpectedly (exit code {self.proc.wait()})")

    def stop(self) -> None:
        """Done: the worker returns (one still starting is stopped: waiting for it gains nothing)."""
        if not self.ready:
            return self.kill()
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.wait()

    def kill(self) -> None:
        """Stop it now, if it has not returned (an error here, Ctrl-C, an abandoned generator)."""
        self.conn.close()
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait()


def engine():
    """The per-shard engine of a step computed on its own: the calling thread (the workers are
    the parallelism), or ``GRPOLENS_THREADS`` threads when set."""
    from grpolens.metrics.engine import InlineEngine, ThreadEngine

    threads = env_int("GRPOLENS_THREADS")
    return ThreadEngine(threads) if threads is not None else InlineEngine()


def _rebuilt(cls: type, args: tuple, attrs: dict, trace: str) -> BaseException:
    """The worker's exception, as it raised it (without calling ``__init__``, whose arguments
    may differ from ``args``: :class:`~grpolens.errors.RunFormatError`)."""
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(attrs)
    exc.add_note(f"raised in a recompute worker process:\n{trace}")
    return exc


def _serve(fd: int) -> None:
    """A worker: compute the steps the pipe ``fd`` sends until it sends None (or closes)."""
    from multiprocessing.connection import Connection

    from grpolens.allocator import keep_freed_memory

    keep_freed_memory()  # a process that only recomputes, like the command line's
    from grpolens.run.no_pandas import pyarrow_without_pandas

    pyarrow_without_pandas(program=True)  # nor does it hand pyarrow pandas objects: skip pandas' import
    conn = Connection(fd)
    try:
        path, spec = pickle.loads(conn.recv_bytes())
        try:
            sys.path[:] = path  # as the parent has it: its plugins import here too
            from grpolens import plugins

            plugins.load_plugins()
            work = spec.work()
        except Exception as e:  # noqa: BLE001 - the parent computes the steps itself
            conn.send(("unavailable", f"{type(e).__name__}: {e}"))
            return
        conn.send(("ready",))
        _serve_steps(conn, spec, work, _StepRows() if spec.step_tables else None)
    except (BrokenPipeError, ConnectionResetError, EOFError):  # the parent is gone (Ctrl-C, an error there)
        return


def _serve_steps(conn, spec, work, spill) -> None:
    """The worker's loop: each step the parent sends, computed and sent back, until None."""
    import traceback

    threads = engine()
    while True:
        step = conn.recv()
        if step is None:
            return
        try:
            row, present = work.one_step(step, spec.token_steps, spill, threads)
            tables = {} if spill is None else spill.take()
        except Exception as e:  # noqa: BLE001 - sent to the parent, which raises it
            try:
                conn.send(("error", type(e), e.args, dict(vars(e)), traceback.format_exc()))
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
                conn.send(("error", RuntimeError, (f"{type(e).__name__}: {e}",), {}, traceback.format_exc()))
            return
        conn.send(("done", step, row, present, tables))


class _StepRows:
    """A worker's stand-in for the recompute's spill: the step tables' rows of the step it is
    computing, sent to the parent with the step's row (:meth:`take`)."""

    def __init__(self):
        self.rows: dict = {}

    def put(self, table: str, step: int, rows) -> None:
        if rows is not None and rows.height:
            self.rows[table] = rows

    def take(self) -> dict:
        """The rows put since the last take, by table."""
        out, self.rows = self.rows, {}
        return out
