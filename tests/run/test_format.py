"""The run format module and its documentation (docs/run-format.md) agree, and format.py behaves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, strategies as st

from grpolens.run import format as fmt

DOC = Path(__file__).resolve().parents[2] / "docs" / "run-format.md"
# The doc uses numpy-style names; Arrow prints float32/float64 as float/double.
_ARROW_NAME = {"float32": "float", "float64": "double"}


def _doc_table(heading_prefix: str) -> dict[str, list[str]]:
    """First markdown table under the heading that starts with ``heading_prefix``: name -> other cells."""
    text = DOC.read_text()
    m = re.search(rf"^#+ {re.escape(heading_prefix)}.*?$(.*?)(?=^#+ |\Z)", text, re.M | re.S)
    assert m, f"no section {heading_prefix!r} in {DOC}"
    rows = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1:]
    assert rows, f"section {heading_prefix!r} has no table"
    return rows


@pytest.mark.parametrize("table, heading", [(fmt.TOKENS, "`tokens`"), (fmt.SAMPLES, "`samples`")])
def test_every_column_is_documented_with_its_type_and_nullability(table, heading):
    doc = _doc_table(heading)
    for col in fmt.COLUMNS[table]:
        assert col.name in doc, f"{table}.{col.name} missing from {DOC.name}"
        typ, null = doc[col.name][0], doc[col.name][1]
        assert _ARROW_NAME.get(typ, typ) == str(col.type), f"{table}.{col.name}: doc says {typ}, code says {col.type}"
        assert null == ("yes" if col.nullable else "no"), f"{table}.{col.name}: nullability differs"
    # and the doc lists nothing the code does not know (reward/<name> is the pattern column)
    extra = set(doc) - {c.name for c in fmt.COLUMNS[table]} - {"reward/<name>"}
    assert not extra, f"documented but not in format.py: {extra}"
    if table == fmt.SAMPLES:
        assert _ARROW_NAME.get(doc["reward/<name>"][0]) == str(fmt.REWARD_COLUMN_TYPE)


def test_every_config_key_is_documented_with_its_default():
    doc = _doc_table("`config` keys")
    for key, default in fmt.CONFIG_DEFAULTS.items():
        assert key in doc, f"config key {key!r} missing from {DOC.name}"
        assert doc[key][0] == f"`{json.dumps(default)}`", f"config {key}: doc default {doc[key][0]} != {default!r}"
    assert set(doc) == set(fmt.CONFIG_DEFAULTS)


def test_manifest_keys_are_documented():
    doc = _doc_table("Manifest")
    assert set(doc) == set(fmt.Manifest("x", completion_markers=True).to_json())
    assert "completion_markers" not in fmt.Manifest("x").to_json()  # old readers see the manifest they knew


def test_completion_records_are_documented(tmp_path):
    """The keys the writer puts in a marker and a finished record are the documented ones."""
    import numpy as np

    from grpolens.capture.writer import ShardWriter

    with ShardWriter(tmp_path, manifest=fmt.Manifest("r")) as w:
        w.add_tokens(0, 0, {"sample_id": np.zeros(2, np.int64), "pos": np.arange(2, dtype=np.int32),
                            "logp": np.zeros(2, np.float32), "advantage": np.zeros(2, np.float32),
                            "mask": np.ones(2, bool)})
        w.end_step(0)
    doc = DOC.read_text()
    section = doc[doc.index("## Completion markers"):doc.index("### Writing into")]
    keys = {"marker": set(), "finished": set()}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in keys:
            keys[cells[0]] |= {k.strip(" `") for k in cells[1].split(",")}
    assert keys["marker"] == set(json.loads((tmp_path / fmt.marker_relpath(0, 0)).read_text()))
    assert keys["finished"] == set(json.loads((tmp_path / fmt.finished_relpath(0)).read_text()))
    assert fmt.read_manifest(tmp_path).completion_markers


@pytest.mark.parametrize("step, rank", [(0, 0), (12, 3), (99_999_999, 99_999)])
def test_completion_record_names_round_trip(step, rank):
    name = Path(fmt.marker_relpath(step, rank))
    assert name.parent.name == fmt.COMPLETE_DIR
    m = fmt.MARKER_RE.match(name.name)
    assert (int(m.group(1)), int(m.group(2))) == (step, rank)
    assert int(fmt.FINISHED_RE.match(Path(fmt.finished_relpath(rank)).name).group(1)) == rank
    assert not fmt.MARKER_RE.match(Path(fmt.finished_relpath(rank)).name)


def test_required_columns_are_exactly_the_non_nullable_ones():
    for table in fmt.TABLES:
        assert set(fmt.REQUIRED[table]) == {c.name for c in fmt.COLUMNS[table] if not c.nullable}
        assert set(fmt.KEY[table]) <= set(fmt.REQUIRED[table])


# -- paths ------------------------------------------------------------------------------------

@given(step=st.integers(0, 10**8 - 1), rank=st.integers(0, 10**5 - 1),
       part=st.none() | st.integers(0, 9999), table=st.sampled_from(fmt.TABLES))
def test_shard_path_round_trip(step, rank, part, table):
    rel = fmt.shard_relpath(table, step, rank, part)
    assert rel.startswith(f"{table}/step=")
    shard = fmt.parse_shard_path(Path("/run") / rel, table)
    assert (shard.step, shard.rank, shard.part) == (step, rank, -1 if part is None else part)


@pytest.mark.parametrize("name, parent", [
    ("rank=0.parquet", "step=00000001"), ("rank=00000.parquet.tmp", "step=00000001"),
    ("rank=00000-1.parquet", "step=00000001"), ("rank=00000.parquet", "step=1"), ("rank=00000.csv", "step=00000001"),
])
def test_parse_shard_path_rejects_off_layout_names(name, parent):
    assert fmt.parse_shard_path(Path("/run/tokens") / parent / name, fmt.TOKENS) is None


def test_shard_relpath_rejects_negative():
    with pytest.raises(ValueError):
        fmt.shard_relpath(fmt.TOKENS, -1, 0)
    with pytest.raises(ValueError):
        fmt.shard_relpath(fmt.TOKENS, 0, -1)


def test_list_shards_sorted_filtered_and_ignores_strays(tmp_path):
    for step, rank, part in [(10, 1, None), (2, 0, 1), (2, 0, 0), (10, 0, None)]:
        p = tmp_path / fmt.shard_relpath(fmt.TOKENS, step, rank, part)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
    (tmp_path / "tokens/step=00000002/notes.txt").write_text("x")
    (tmp_path / "tokens/junk").mkdir()
    got = [(s.step, s.rank, s.part) for s in fmt.list_shards(tmp_path)]
    assert got == [(2, 0, 0), (2, 0, 1), (10, 0, -1), (10, 1, -1)]
    assert [(s.step, s.rank) for s in fmt.list_shards(tmp_path, steps=[10])] == [(10, 0), (10, 1)]
    assert fmt.list_steps(tmp_path) == [2, 10]
    assert fmt.list_shards(tmp_path, fmt.SAMPLES) == [] and fmt.list_steps(tmp_path, fmt.SAMPLES) == []


def test_arrow_schema_orders_columns_and_types_extras():
    s = fmt.arrow_schema(fmt.SAMPLES, ["reward/b", "extra", "sample_id", "step", "reward/a"])
    assert s.names == ["step", "sample_id", "reward/a", "reward/b", "extra"]
    assert s.field("reward/a").type == pa.float64() and s.field("extra").type == pa.float64()
    assert not s.field("step").nullable and s.field("reward/a").nullable


# -- atomic writes ----------------------------------------------------------------------------

def test_atomic_writes_leave_no_temp_files(tmp_path):
    fmt.atomic_write_bytes(tmp_path / "a/b.bin", b"hello")
    assert (tmp_path / "a/b.bin").read_bytes() == b"hello"
    fmt.atomic_write_table(tmp_path / "t.parquet", pa.table({"x": [1, 2]}))
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "t.parquet").column("x").to_pylist() == [1, 2]
    with pytest.raises(Exception):
        fmt.atomic_write_table(tmp_path / "bad.parquet", pa.table({"x": [1]}), compression="no-such-codec")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "t.parquet"]
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.bin"]


# -- manifest ---------------------------------------------------------------------------------

def test_manifest_round_trip_keeps_unknown_keys(tmp_path):
    m = fmt.Manifest("r", world_size=3, trainer={"name": "t", "version": "1"},
                     config={"beta": 0.1, "custom": [1, 2]}, extra={"note": {"a": 1}})
    fmt.write_manifest(tmp_path, m)
    back = fmt.read_manifest(tmp_path)
    assert back.to_json() == m.to_json()
    assert back.resolved_config()["beta"] == 0.1 and back.resolved_config()["epsilon"] == 0.2
    assert back.resolved_config({"beta": 0.5})["beta"] == 0.5
    assert fmt.is_run(tmp_path) and not fmt.is_run(tmp_path / "nope")


def _write(tmp_path, data) -> Path:
    (tmp_path / fmt.MANIFEST_NAME).write_text(data if isinstance(data, str) else json.dumps(data))
    return tmp_path


GOOD = {"format": "grpolens-run", "version": 1, "run_name": "r", "world_size": 1, "config": {}}


@pytest.mark.parametrize("change, message", [
    ({"version": 2}, "newer than this grpolens understands"),
    ({"version": 0}, "not valid"),
    ({"version": "1"}, "'version' must be an integer"),
    ({"version": True}, "'version' must be an integer"),
    ({"format": "other"}, "'format' must be"),
    ({"config": [1]}, "'config' must be a JSON object"),
    ({"trainer": "trl"}, "'trainer' must be a JSON object"),
    ({"world_size": 0}, "'world_size' must be an integer from 1 to 100,000"),
    ({"world_size": 100_001}, "'world_size' must be an integer from 1 to 100,000 (ranks are written as 5 digits), got 100001"),
    ({"run_name": 5}, "'run_name' must be a string, got 5"),
    ({"world_size": "2"}, "'world_size' must be an integer from 1 to 100,000"),
    ({"completion_markers": "yes"}, "'completion_markers' must be true or false"),
])
def test_read_manifest_rejects_bad_fields(tmp_path, change, message):
    _write(tmp_path, {**GOOD, **change})
    with pytest.raises(fmt.RunFormatError, match=re.escape(message)) as e:
        fmt.read_manifest(tmp_path)
    assert e.value.path.endswith(fmt.MANIFEST_NAME)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object"), ("", "not valid JSON"),
])
def test_read_manifest_rejects_bad_json(tmp_path, text, message):
    _write(tmp_path, text)
    with pytest.raises(fmt.RunFormatError, match=message):
        fmt.read_manifest(tmp_path)


def test_read_manifest_missing_file_and_directory(tmp_path):
    with pytest.raises(fmt.RunFormatError, match="manifest missing"):
        fmt.read_manifest(tmp_path)
    with pytest.raises(fmt.RunFormatError, match="does not exist"):
        fmt.read_manifest(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(fmt.RunFormatError, match="not a directory"):
        fmt.read_manifest(tmp_path / "file")


def test_read_manifest_defaults(tmp_path):
    _write(tmp_path, {"format": "grpolens-run", "version": 1})
    m = fmt.read_manifest(tmp_path)
    assert m.run_name == tmp_path.name and m.world_size == 1 and m.config == {}
    assert m.completion_markers is False  # a run written before markers: read as before
