"""The engine's plumbing: thread count, engine choice and its messages, step order, visitor
registration. The pass itself (reading shards, merging pieces) is covered by every family's tests."""

import pytest

from grpolens.errors import UserError
from grpolens.metrics import engine
from grpolens.metrics.engine import ENGINES, InlineEngine, ThreadEngine, make_engine, visitor, visitor_factories


@pytest.mark.parametrize("env, cpus, want", [("3", 8, 3), ("1", 8, 1), (" 2 ", 8, 2), ("1024", 8, 1024), ("", 8, 4),
                                             (None, 8, 4), (None, 3, 3), (None, 1, 1), (None, None, 1)])
def test_thread_count(monkeypatch, env, cpus, want):
    """GRPOLENS_THREADS when set (1 to 1,024), else the CPUs up to 4 (1 when unknown)."""
    if env is None:
        monkeypatch.delenv("GRPOLENS_THREADS", raising=False)
    else:
        monkeypatch.setenv("GRPOLENS_THREADS", env)
    monkeypatch.setattr(engine.os, "cpu_count", lambda: cpus)
    assert engine._threads() == want
    assert ThreadEngine().threads == want
    assert ThreadEngine(2).threads == 2


@pytest.mark.parametrize("env", ["abc", "0", "-2", "1025", "2.5", "\u0663", "1e3"])
def test_a_thread_count_that_is_no_count_is_one_line(monkeypatch, env):
    """GRPOLENS_THREADS=abc (0, 1,025, an Arabic-Indic 3 that int() would read) names the variable."""
    monkeypatch.setenv("GRPOLENS_THREADS", env)
    with pytest.raises(UserError, match=rf"^GRPOLENS_THREADS: expected a whole number from 1 to 1,024, got {env!r}$"):
        engine._threads()


def test_engine_choice_and_its_messages():
    assert isinstance(make_engine(), ThreadEngine) and isinstance(make_engine("default"), ThreadEngine)
    with pytest.raises(UserError, match=r"^--ray-address needs --engine ray$"):
        make_engine("default", "ray://head:10001")
    with pytest.raises(UserError, match=r"^--engine: unknown engine 'spark'; choose one of default, ray$"):
        make_engine("spark")
    assert ENGINES == ("default", "ray")
    pytest.importorskip("ray")
    ray_engine = make_engine("ray", "ray://head:10001")  # nothing is started before the first step
    assert type(ray_engine).__name__ == "RayEngine" and ray_engine.address == "ray://head:10001"


@pytest.mark.parametrize("eng", [InlineEngine(), ThreadEngine(2)])
def test_engines_yield_steps_in_order_and_results_in_shard_order(eng):
    by_step = {7: ["c", "d", "e"], 2: ["a"], 5: []}
    assert list(eng.map_steps(by_step, str.upper)) == [(2, ["A"]), (5, []), (7, ["C", "D", "E"])]


def test_visitor_registration():
    diversity = visitor_factories(frozenset({"diversity"}))
    assert engine.VISITORS["sample_tokens"] in diversity
    assert all(not frozenset({"diversity"}).isdisjoint(engine.VISITOR_FAMILIES[n])
               for n, f in engine.VISITORS.items() if f in diversity)
    assert visitor_factories(frozenset()) == [] and visitor_factories() == list(engine.VISITORS.values())
    output_only = [n for n, fams in engine.VISITOR_FAMILIES.items() if not fams]
    assert output_only and all(engine.VISITORS[n] not in visitor_factories(frozenset({"diversity", "rewards"}))
                               for n in output_only)
    with pytest.raises(ValueError, match=r"^visitor sample_tokens registered twice$"):
        visitor("sample_tokens", families=("diversity",))(lambda cfg: None)
    try:
        factory = visitor("tests_only", families=["a", "b"])(lambda cfg: cfg)
        assert engine.VISITORS["tests_only"] is factory and engine.VISITOR_FAMILIES["tests_only"] == ("a", "b")
        assert visitor_factories(frozenset({"b"})) == [factory]
    finally:
        engine.VISITORS.pop("tests_only", None)
        engine.VISITOR_FAMILIES.pop("tests_only", None)


def test_a_shard_whose_rows_disagree_with_its_path(tmp_path):
    """The per-shard work refuses a tokens shard whose rows name another step or rank than its path
    (one line naming the file and the column), and hands every visitor the shard's batch."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from grpolens.errors import RunFormatError
    from grpolens.metrics.engine import shard_pieces
    from grpolens.run import format as fmt
    from grpolens.run.reader import READ_COLUMNS
    from tests.refdata import random_calls, write_run

    run = write_run(tmp_path / "run", random_calls(np.random.default_rng(3), steps=(0, 1), ranks=2))
    shards = {(sh.step, sh.rank): sh for sh in fmt.list_shards(run, fmt.TOKENS)}
    class Keys:  # a visitor that keeps each shard's sequence keys and what it was handed
        name = "keys"

        def shard(self, batch, shard):
            return shard, batch.seq_keys

    got = shard_pieces(shards[0, 1], (Keys(),), tuple(READ_COLUMNS))
    sh, keys = got["keys"]
    assert list(got) == ["keys"] and sh is shards[0, 1]
    assert set(keys["rank"].tolist()) == {1} and set(keys["step"].tolist()) == {0} and len(keys["sample_id"])
    for (step, rank), column in (((0, 1), "rank"), ((1, 0), "step")):
        sh = shards[step, rank]
        t = pq.read_table(sh.path)
        i = t.column_names.index(column)
        pq.write_table(t.set_column(i, column, pa.array(np.full(t.num_rows, 5), t.schema.field(column).type)), sh.path)
        with pytest.raises(RunFormatError) as e:
            shard_pieces(sh, (Keys(),), tuple(READ_COLUMNS))
        assert e.value.path == str(sh.path) and e.value.column == "step"
        assert e.value.message == f"rows disagree with the path (step={step}, rank={rank})"


def _run(tmp_path):
    import numpy as np

    from tests.refdata import random_calls, write_run

    return write_run(tmp_path / "run", random_calls(np.random.default_rng(5), steps=(0, 1, 2), ranks=2))


class RecordingEngine(InlineEngine):
    """The inline engine, noting the shards of each step it was handed."""

    def __init__(self):
        self.calls: list[dict] = []

    def map_steps(self, by_step, work):
        self.calls.append({s: [(sh.step, sh.rank) for sh in shards] for s, shards in by_step.items()})
        yield from super().map_steps(by_step, work)


class ShardsSeen:
    """A visitor whose piece is the shard it ran on and the optional columns its batch holds."""

    name = "seen"

    def shard(self, batch, shard):
        return shard.step, shard.rank, sorted(batch.present)

    def combine(self, step, pieces):
        return step, pieces


def test_iter_steps_runs_the_requested_steps_on_the_engine_it_is_given(tmp_path):
    """The steps asked for, each with its own shards, through the given engine; each step's pieces
    combined in shard order, ``on_step`` told each step, and only the columns asked for read."""
    from grpolens.metrics.engine import iter_steps

    engine_ = RecordingEngine()
    ticks = []
    got = list(iter_steps(_run(tmp_path), [2, 0], [ShardsSeen()], on_step=ticks.append, engine=engine_,
                          columns=("step", "rank", "micro_batch", "sample_id", "pos", "logp", "advantage", "mask",
                                   "entropy")))
    assert engine_.calls == [{0: [(0, 0), (0, 1)], 2: [(2, 0), (2, 1)]}]  # step 1 was not asked for
    assert [r.step for r in got] == [0, 2] and ticks == [0, 2]
    assert [r.pieces["seen"] for r in got] == [
        (step, [(step, rank, ["advantage", "entropy", "logp"]) for rank in (0, 1)]) for step in (0, 2)]


def test_sequence_partials_of_some_families_only_and_who_may_reuse_them(tmp_path):
    """A pass restricted to some metric families runs only their producers and leaves nothing on
    the batch (another visitor must not take a partial table for the whole one); an unrestricted
    pass leaves its table for the other visitors of the pass (the completions view reuses it)."""
    from grpolens.metrics.batch import TokenBatch
    from grpolens.metrics.engine import SequencePartials
    from grpolens.metrics.partials import PRODUCERS
    from grpolens.run import format as fmt
    from grpolens.run.reader import READ_COLUMNS, read_tokens, resolve_config

    run = _run(tmp_path)
    cfg = resolve_config(run)
    sh = fmt.list_shards(run, fmt.TOKENS, steps=[0])[0]
    keys = {"step", "rank", "micro_batch", "sample_id", "seq_tokens"}
    kl_only = {c for p in PRODUCERS.values() if "kl" in p.families for c in p.merge}
    batch = TokenBatch.from_arrow(read_tokens(sh.path, READ_COLUMNS))
    cols, present = SequencePartials(cfg, frozenset({"kl"})).shard(batch, sh)
    assert set(cols) == keys | kl_only and batch.partials is None
    assert present == {"advantage", "entropy", "logp", "old_logp", "ref_logp", "rollout_logp", "token_id"}
    batch = TokenBatch.from_arrow(read_tokens(sh.path, READ_COLUMNS))
    cols, _ = SequencePartials(cfg).shard(batch, sh)
    assert set(cols) > keys | kl_only and batch.partials is cols


def test_a_steps_partials_hold_every_shards_rows_and_any_shards_columns():
    """``combine``: one row per sequence of every piece, and the optional token columns present
    in any of the step's shards (a column one rank lacks is still the step's)."""
    import numpy as np

    from grpolens.metrics.engine import SequencePartials

    def piece(rank, n):
        return {"step": np.zeros(n, np.int64), "rank": np.full(n, rank, np.int64),
                "micro_batch": np.zeros(n, np.int64), "sample_id": np.arange(n, dtype=np.int64),
                "seq_tokens": np.full(n, 3.0)}

    cols, present = SequencePartials({}).combine(0, [(piece(0, 2), {"logp", "old_logp"}),
                                                      (piece(1, 3), {"logp", "entropy"})])
    assert present == {"logp", "old_logp", "entropy"}
    assert cols["rank"].tolist() == [0, 0, 1, 1, 1] and cols["sample_id"].tolist() == [0, 1, 0, 1, 2]


def test_the_thread_engine_imports_nothing_under_its_threads():
    """The first shard runs in the calling thread before any pool thread exists (its lazy imports
    happen there), and the next step is read ahead only once the caller is done with the first
    (the caller's own lazy imports for a step happen with no pool thread working): a Ctrl-C that
    lands in an import while another thread imports can leave the main thread waiting on
    importlib's lock for ever."""
    import threading

    events = []

    def work(sh):
        events.append(("shard", sh, threading.current_thread() is threading.main_thread()))
        return sh

    gen = ThreadEngine(threads=2).map_steps({0: ["0a", "0b"], 1: ["1a", "1b"], 2: ["2a"]}, work)
    step, got = next(gen)
    assert (step, got) == (0, ["0a", "0b"])
    assert events[0] == ("shard", "0a", True)  # before the pool: here
    assert {e[1] for e in events} == {"0a", "0b"}  # no shard of step 1 read ahead yet
    events.append(("caller done with", 0))
    assert list(gen) == [(1, ["1a", "1b"]), (2, ["2a"])]
    assert events.index(("caller done with", 0)) == 2
    assert [e[2] for e in events if e[0] == "shard"][2:] == [False] * 3  # then the pool, reading ahead


def test_a_thread_engine_left_early_does_not_wait_for_its_threads():
    """A caller leaving the pass (an error, Ctrl-C) is not held up by the shard under way in the
    pool: the pool is shut down without waiting (its thread finishes the shard and ends)."""
    import threading

    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def work(sh):
        if sh == "2a":  # read ahead while the caller holds step 1
            started.set()
            release.wait(60)
            finished.set()
        return sh

    gen = ThreadEngine(threads=1).map_steps({0: ["0a"], 1: ["1a"], 2: ["2a"], 3: ["3a"]}, work)
    assert [next(gen), next(gen)] == [(0, ["0a"]), (1, ["1a"])]
    assert started.wait(60)
    gen.close()  # returns with step 2's shard still running: it would wait 60 s for it
    assert not finished.is_set()
    release.set()
    assert finished.wait(60)


def test_a_recompute_imports_nothing_while_pool_threads_work(tmp_path):
    """End to end, in a fresh interpreter (nothing imported yet): a recompute on pool threads
    imports nothing off the main thread, and nothing at all once it reads steps ahead (from the
    second step's tick to the last), where an import could meet another thread's and hang a
    Ctrl-C (``recompute RUN`` then waited on importlib's lock in about 1 of 30 Ctrl-Cs)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from grpolens.adapters.synth import synth_run

    run = synth_run(tmp_path / "run", steps=6, ranks=2, texts=True)
    code = r"""
import json, sys, threading
events = []

class Spy:  # the import system asks every finder for a module not yet imported
    def find_spec(self, name, path=None, target=None):
        events.append(["import", threading.current_thread().name, name])

sys.meta_path.insert(0, Spy())
import grpolens
grpolens.recompute(sys.argv[1], workers=1, progress=lambda done, total: events.append(["step", done, total]))
print(json.dumps(events))
"""
    env = {**os.environ, "GRPOLENS_THREADS": "2", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    events = json.loads(r.stdout.strip().splitlines()[-1])
    ticks = [i for i, e in enumerate(events) if e[0] == "step"]
    assert len(ticks) == 6 and any(e[0] == "import" for e in events[:ticks[0]])  # the spy saw the imports
    assert [e for e in events if e[0] == "import" and e[1] != "MainThread"] == []
    assert [e for e in events[ticks[1]:ticks[-1]] if e[0] == "import"] == []
