"""The one run reader: config precedence, step selection, token and sample reads, output location."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from grpolens.adapters.synth import synth_run
from grpolens.errors import RunFormatError, UserError
from grpolens.run import format as fmt
from grpolens.run.reader import RunReader, out_dir, read_samples


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return synth_run(tmp_path_factory.mktemp("reader") / "r", steps=4, ranks=2, micro_batches=2, groups=2,
                     generations=2, max_len=12, texts=True)


def test_config_precedence_manifest_then_file_then_set(run, tmp_path):
    reader = RunReader(run)
    assert reader.config()["epsilon"] == reader.manifest.resolved_config()["epsilon"]
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"config": {"epsilon": 0.3, "epsilon_high": 0.4}}))
    cfg = reader.config(config_file=f)
    assert (cfg["epsilon"], cfg["epsilon_high"]) == (0.3, 0.4)
    cfg = reader.config({"epsilon": 0.1}, f)  # --set wins over --config
    assert (cfg["epsilon"], cfg["epsilon_high"]) == (0.1, 0.4)
    with pytest.raises(UserError, match="config key 'epsilon'"):
        reader.config({"epsilon": "abc"})
    assert reader.config({"epsilon": "abc"}, check=False)["epsilon"] == "abc"


def test_step_selection(run):
    reader = RunReader(run)
    assert reader.steps() == [0, 1, 2, 3]
    assert reader.select_steps("1:2")[0] == [1, 2]
    assert reader.select_steps((None, 1))[0] == [0, 1]
    with pytest.raises(UserError, match="--steps: no steps of the run fall in 7:9"):
        reader.select_steps("7:9")
    empty = run.parent / "empty"
    empty.mkdir()
    (empty / fmt.MANIFEST_NAME).write_bytes((run / fmt.MANIFEST_NAME).read_bytes())
    with pytest.raises(RunFormatError, match="no token or sample shards"):
        RunReader(empty).select_steps(None)


def test_tokens_and_samples_are_every_rank(run):
    reader = RunReader(run)
    t = reader.tokens(2)
    shards = reader.shards(fmt.TOKENS, [2])
    assert len(shards) == 2
    assert t.num_rows == sum(pq.read_metadata(sh.path).num_rows for sh in shards)
    assert set(np.unique(t.column("rank").to_numpy())) == {0, 1}
    s = reader.samples(2)
    assert s.height == sum(pq.read_metadata(sh.path).num_rows for sh in reader.shards(fmt.SAMPLES, [2]))
    assert "completion" in s.columns and set(s["step"].unique()) == {2}
    assert reader.tokens(99) is None and read_samples(run, 99) is None
    assert "completion" in reader.sample_columns()


def test_output_location(run):
    assert out_dir(run) == run / "grpolens"
    assert RunReader(run).out_dir("trl") == run / "grpolens" / "trl"


def _counting_manifest_reads(monkeypatch) -> list:
    reads = []
    real = fmt.read_manifest

    def counted(run):
        reads.append(str(run))
        return real(run)

    monkeypatch.setattr(fmt, "read_manifest", counted)
    return reads


def test_a_reader_reads_the_manifest_once_for_every_steps_samples(run, monkeypatch):
    """``read_samples`` bounds completion_len by the manifest's max_completion_length; a reader
    hands it the manifest it read once, not once per step (a GET per step on ``s3://``)."""
    reader = RunReader(run)
    reads = _counting_manifest_reads(monkeypatch)
    frames = [reader.samples(s) for s in reader.steps(fmt.SAMPLES)]
    assert len(frames) > 2 and all(f is not None for f in frames)
    assert len(reads) == 1
    reads.clear()
    read_samples(run, 0)  # on its own, it reads the manifest itself
    assert len(reads) == 1


def test_a_recompute_reads_the_manifest_as_often_for_many_steps_as_for_few(tmp_path, monkeypatch):
    """Per recompute, not per step: twice the steps, the same number of manifest reads (the steps'
    samples, the cumulative metrics before ``--steps``, the completions table)."""
    import grpolens

    counts = {}
    for n in (3, 6):
        r = synth_run(tmp_path / f"run{n}", steps=n, ranks=2, texts=True)
        reads = _counting_manifest_reads(monkeypatch)
        grpolens.recompute(r, workers=1, steps="1:")
        counts[n] = len(reads)
        monkeypatch.undo()
    assert counts[3] == counts[6], counts
