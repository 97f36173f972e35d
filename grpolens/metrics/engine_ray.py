"""``--engine ray``: the per-shard work of :mod:`grpolens.metrics.engine` as Ray tasks.

Nothing here computes a metric. Each task runs :func:`grpolens.metrics.engine.shard_pieces` -- the
function the default engine runs on its threads -- on a group of one step's shards, and returns
their pieces (per-sequence partial states, histograms, top-K candidates); the driver merges them
with the visitors' ``combine`` exactly as the default engine does, so results are identical.

* The workers read the shards themselves, from wherever the run lives (a path on a filesystem
  every node mounts, or ``s3://``, with the driver's resolved credentials shipped in the task);
  no token row goes through the driver.
* ``--ray-address auto`` or ``ray://host:10001`` joins an existing cluster (grpolens must be
  installed on its nodes); without it a local Ray instance starts and stops with the command.
* A worker that dies mid-task is retried by Ray (``max_retries``); a task that fails on a shard
  (unreadable, missing, wrong rows) is not retried: the driver stops with one line naming the shard.
* At most ``2 x cluster CPUs`` tasks are in flight, so the driver holds a bounded number of
  steps' pieces whatever the run's length.

This module is the only one that imports ``ray`` (the ``ray`` extra); the core never does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from grpolens.errors import RunFormatError, UserError

#: Shards per task: a step's shards are split into groups of at most this many.
SHARDS_PER_TASK = 8
#: Ray retries a task this many times when its worker dies (not on an exception in grpolens).
MAX_RETRIES = 3
#: Tasks in flight per cluster CPU: enough to keep every worker busy while the driver merges, few
#: enough that the driver holds only those tasks' pieces.
TASKS_PER_CPU = 2
#: how long ``--ray-address`` waits for a TCP answer before saying nothing answers there (a host that
#: drops packets; a closed port answers at once)
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ShardFailure:
    """A task's error on a shard, returned (not raised) so the driver can print one line."""

    path: str
    message: str
    column: str | None = None
    storage: bool = False  # a storage error: its message already names the object


def _run_group(work: Callable, shards: list) -> list[dict[str, Any]] | ShardFailure:
    from grpolens.metrics.registry import load_families
    from grpolens.run.storage import StorageError

    load_families()  # a fresh worker has only the modules unpickling imported: register every producer
    out = []
    for sh in shards:
        try:
            out.append(work(sh))
        except RunFormatError as e:
            return ShardFailure(e.path, e.message, e.column)
        except (StorageError, UserError) as e:
            return ShardFailure(str(sh.path), e.message, storage=True)
        except (OSError, ValueError) as e:
            return ShardFailure(str(sh.path), f"unreadable shard: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return out


def _import_ray():
    try:
        import ray
    except ImportError:
        raise UserError("--engine ray needs Ray: pip install 'grpolens[ray]'") from None
    return ray


def _in_flight_limit(resources: dict[str, float]) -> int:
    """Tasks in flight on a cluster with these resources (``ray.cluster_resources()``):
    ``TASKS_PER_CPU`` per CPU, and never fewer than 2 (the step waited for and the next)."""
    return max(2, TASKS_PER_CPU * int(resources.get("CPU", 1)))


def _check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """One line at once when nothing listens at ``HOST:PORT`` or ``ray://HOST:PORT`` (Ray itself
    retries such an address for minutes before it gives up). ``auto`` is left to Ray."""
    import socket

    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or "/" in hostport:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except TimeoutError:
        raise UserError(f"--ray-address {address}: cannot connect: nothing answers at {host}:{port} "
                        f"(no answer within {timeout:g} s)") from None
    except OSError as e:
        raise UserError(f"--ray-address {address}: cannot connect: nothing answers at {host}:{port} "
                        f"({e.strerror or e})") from None


class RayEngine:
    """Runs the per-shard work as Ray tasks (see the module docstring)."""

    def __init__(self, address: str | None = None, shards_per_task: int = SHARDS_PER_TASK):
        self.address = address
        self.shards_per_task = max(1, shards_per_task)
        self._remote = None
        self._started = False

    def _ensure(self):
        ray = _import_ray()
        if not ray.is_initialized():
            # workers import grpolens from where this process does (a source checkout included)
            src = str(Path(__file__).resolve().parents[2])
            path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
            if self.address:
                _check_reachable(self.address)
            try:
                if self.address:
                    ray.init(address=self.address, logging_level="ERROR", log_to_driver=False)
                else:
                    ray.init(runtime_env={"env_vars": {"PYTHONPATH": path}}, logging_level="ERROR",
                             log_to_driver=False, include_dashboard=False)
            except (OSError, RuntimeError, ValueError) as e:  # OSError: ConnectionError, a temp dir Ray cannot use
                if self.address:
                    where = f"--ray-address {self.address}: cannot connect"
                elif os.environ.get("RAY_ADDRESS"):  # ray.init() joins the cluster this variable names
                    where = f"RAY_ADDRESS={os.environ['RAY_ADDRESS']} (set in the environment): cannot connect"
                else:
                    where = "--engine ray: cannot start a local Ray instance"
                raise UserError(f"{where}: {str(e).splitlines()[0]}") from None
            self._started = True
        if self._remote is None:
            self._remote = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(_run_group)
        return ray

    def close(self) -> None:
        if self._started:
            import ray

            ray.shutdown()
            self._started = False
            self._remote = None

    def map_steps(self, by_step: dict[int, list], work: Callable) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        ray = self._ensure()
        try:
            yield from self._map(ray, by_step, work)
        finally:
            self.close()

    def _map(self, ray, by_step, work):
        work_ref = ray.put(work)  # the visitors and their config, shipped once
        order = sorted(by_step)
        tasks = [(step, by_step[step][i:i + self.shards_per_task])
                 for step in order for i in range(0, len(by_step[step]), self.shards_per_task)]
        window = _in_flight_limit(ray.cluster_resources())
        pending: dict[int, list] = {s: [] for s in order}  # step -> its tasks' refs, in shard order
        remaining = {s: sum(1 for t, _ in tasks if t == s) for s in order}
        done: dict[Any, Any] = {}
        inflight: list = []
        nxt = 0
        for step in order:
            while True:
                # keep the window full; the step being waited for is always submitted first
                while nxt < len(tasks) and len(inflight) < window:
                    s, group = tasks[nxt]
                    ref = self._remote.remote(work_ref, group)
                    pending[s].append(ref)
                    inflight.append(ref)
                    nxt += 1
                # every task of the step submitted and done (at once for a step without a shard)
                if len(pending[step]) == remaining[step] and all(r in done for r in pending[step]):
                    break
                ready, inflight = ray.wait(inflight, num_returns=1)
                for ref in ready:
                    done[ref] = ray.get(ref)
                    if isinstance(done[ref], ShardFailure):
                        f = done[ref]
                        for r in inflight:
                            ray.cancel(r)
                        if f.storage:
                            from grpolens.run.storage import StorageError

                            raise StorageError(f.message)
                        raise RunFormatError(f.path, f.message, f.column)
            results = []
            for ref in pending.pop(step):
                results.extend(done.pop(ref))
            yield step, results
