"""The parts of ``--engine ray`` that need no Ray instance: how a task reports a shard's error
(``_run_group`` runs in a worker, where an exception would lose the shard's name), how
``--ray-address`` is checked before Ray retries it for minutes, and the engine's settings. The
engine itself, on a real local Ray instance, is tested in ``tests/distributed/test_ray_engine.py``."""

from __future__ import annotations

import builtins
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpolens.errors import RunFormatError, UserError
from grpolens.metrics import engine_ray
from grpolens.metrics.engine_ray import RayEngine, ShardFailure, _check_reachable, _in_flight_limit, _run_group
from grpolens.run.storage import StorageError


def _shards(*names: str) -> list:
    return [SimpleNamespace(path=Path("/runs/r/tokens") / n) for n in names]


def _failing_on(name: str, error: Exception):
    def work(sh):
        if sh.path.name == name:
            raise error
        return {"shard": sh.path.name}
    return work


def test_a_group_returns_every_shards_pieces_in_order():
    assert _run_group(lambda sh: {"shard": sh.path.name}, _shards("a", "b", "c")) == [
        {"shard": "a"}, {"shard": "b"}, {"shard": "c"}]
    assert _run_group(lambda sh: {}, []) == []


def test_a_format_error_keeps_its_file_message_and_column():
    err = RunFormatError("/runs/r/tokens/b", "column has nulls", column="logp")
    got = _run_group(_failing_on("b", err), _shards("a", "b", "c"))
    assert got == ShardFailure("/runs/r/tokens/b", "column has nulls", "logp", storage=False)


def test_a_storage_or_user_error_names_the_shard_and_is_marked_as_storage():
    for err in (StorageError("s3://bucket/run: access denied"), UserError("credentials expired")):
        got = _run_group(_failing_on("b", err), _shards("a", "b"))
        assert got == ShardFailure("/runs/r/tokens/b", err.message, None, storage=True)


@pytest.mark.parametrize(("error", "message"), [
    (OSError("disk gone\nsecond line"), "unreadable shard: disk gone"),
    (ValueError("bad footer"), "unreadable shard: bad footer"),
    (OSError(), "unreadable shard: OSError"),  # no text: its type says what happened
])
def test_an_unreadable_shard_is_named_with_the_first_line_of_the_error(error, message):
    got = _run_group(_failing_on("a", error), _shards("a", "b"))
    assert got == ShardFailure("/runs/r/tokens/a", message, None, storage=False)


def test_any_other_exception_is_left_to_ray():
    with pytest.raises(KeyError):
        _run_group(_failing_on("a", KeyError("x")), _shards("a"))


def test_a_worker_registers_the_builtin_producers_before_its_first_shard(monkeypatch):
    calls = []
    monkeypatch.setattr("grpolens.metrics.registry.load_families", lambda: calls.append("loaded"))
    _run_group(lambda sh: calls.append(sh.path.name), _shards("a"))
    assert calls == ["loaded", "a"]


def test_an_address_nothing_answers_at_is_one_line():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(UserError) as e:
            _check_reachable(address, timeout=2.0)
        assert e.value.message == (
            f"--ray-address {address}: cannot connect: nothing answers at 127.0.0.1:{port} (Connection refused)")


def test_a_listening_address_passes_and_brackets_are_stripped_from_ipv6():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _check_reachable(f"127.0.0.1:{port}")
        _check_reachable(f"ray://127.0.0.1:{port}")
    if socket.has_ipv6:
        try:
            s6 = socket.socket(socket.AF_INET6)
            s6.bind(("::1", 0))
        except OSError:
            return  # no IPv6 loopback on this machine
        with s6:
            port6 = s6.getsockname()[1]
            s6.listen()
            _check_reachable(f"[::1]:{port6}")
        # the port is the part after the last colon, the host's own colons stay in the host
        with pytest.raises(UserError, match=rf"nothing answers at \[::1\]:{port6} \(Connection refused\)$"):
            _check_reachable(f"[::1]:{port6}", timeout=2.0)


def test_only_an_ipv6_literals_brackets_are_stripped_from_the_host():
    """``127.0.0.1X`` is a host name (one that does not resolve), not the address 127.0.0.1 with
    something around it: only the brackets of ``[::1]`` are stripped before the connect, so the
    check fails though something listens at 127.0.0.1 on that port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for host in ("127.0.0.1X", "X127.0.0.1"):
            with pytest.raises(UserError) as e:
                _check_reachable(f"{host}:{port}", timeout=2.0)
            assert e.value.message.startswith(f"--ray-address {host}:{port}: cannot connect: nothing answers at {host}:{port} (")


@pytest.mark.timeout(30)  # without a time limit the connect waits for the kernel's SYN retries (minutes)
def test_an_address_that_drops_the_connection_request_is_given_up_at_the_time_limit():
    """A host that drops packets, made here: a listening socket whose accept queue is full and never
    read (Linux then drops every further SYN). The connect gives up at its time limit, one line
    that says so."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        fillers = [socket.socket() for _ in range(4)]
        try:
            for c in fillers:
                c.setblocking(False)
                c.connect_ex(("127.0.0.1", port))
            with pytest.raises(UserError) as e:
                _check_reachable(f"127.0.0.1:{port}", timeout=0.5)
        finally:
            for c in fillers:
                c.close()
    assert e.value.message == (
        f"--ray-address 127.0.0.1:{port}: cannot connect: nothing answers at 127.0.0.1:{port} "
        "(no answer within 0.5 s)")


def test_the_connect_limit_is_the_one_the_docs_state():
    from grpolens.metrics.engine_ray import CONNECT_TIMEOUT_S

    doc = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    assert f"is given up after {CONNECT_TIMEOUT_S:g} s" in doc


@pytest.mark.parametrize("address", ["auto", "localhost", "host:port", "ray://host/x:10001", "10.0.0.1:"])
def test_addresses_that_are_not_host_and_port_are_left_to_ray(address, monkeypatch):
    def connect(*a, **k):
        raise AssertionError(f"{address!r} was dialled")
    monkeypatch.setattr(socket, "create_connection", connect)
    _check_reachable(address)


@pytest.mark.parametrize(("resources", "limit"), [
    ({"CPU": 1.0}, 2),  # TASKS_PER_CPU (2) per CPU
    ({"CPU": 4.0, "GPU": 1.0, "memory": 8e9}, 8),
    ({"CPU": 3.0}, 6),
    ({"CPU": 0.5}, 2),  # never fewer than 2: the step waited for and the next
    ({}, 2),  # a cluster that reports no CPU is counted as one
])
def test_tasks_in_flight_are_two_per_cluster_cpu_and_at_least_two(resources, limit):
    assert _in_flight_limit(resources) == limit


def test_engine_settings():
    assert RayEngine().shards_per_task == engine_ray.SHARDS_PER_TASK == 8
    assert RayEngine(shards_per_task=3).shards_per_task == 3
    assert RayEngine(shards_per_task=0).shards_per_task == 1  # a group holds at least one shard
    e = RayEngine(address="ray://head:10001")
    assert e.address == "ray://head:10001" and e._remote is None and e._started is False
    assert RayEngine().address is None
    e.close()  # nothing started: nothing to stop (and no import of ray)
    assert e._started is False


def test_without_ray_the_engine_says_which_extra_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(UserError) as e:
        RayEngine()._ensure()
    assert e.value.message == "--engine ray needs Ray: pip install 'grpolens[ray]'"
