"""The engine's plumbing: thread count, engine choice and its messages, step order, visitor
registration. The pass itself (reading shards, merging pieces) is covered by every family's tests."""

import pytest

from grpolens.errors import UserError
from grpolens.metrics import engine
from grpolens.metrics.engine import ENGINES, InlineEngine, ThreadEngine, make_engine, visitor, visitor_factories


@pytest.mark.parametrize("env, cpus, want", [("3", 8, 3), ("1", 8, 1), ("0", 8, 1), ("-2", 8, 1),
                                             (None, 8, 4), (None, 3, 3), (None, 1, 1), (None, None, 1)])
def test_thread_count(monkeypatch, env, cpus, want):
    """GRPOLENS_THREADS when set (at least 1), else the CPUs up to 4 (1 when unknown)."""
    if env is None:
        monkeypatch.delenv("GRPOLENS_THREADS", raising=False)
    else:
        monkeypatch.setenv("GRPOLENS_THREADS", env)
    monkeypatch.setattr(engine.os, "cpu_count", lambda: cpus)
    assert engine._threads() == want
    assert ThreadEngine().threads == want
    assert ThreadEngine(2).threads == 2


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
