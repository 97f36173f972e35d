"""validate: token rows joined to samples rows (orphans, unreadable samples), non-finite values, and
the tokenizer file."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from grpolens.run.validate import WARNING, Problem, check_before_reading, validate_run

from tests.run.validate.helpers import SMP, TOK, only, rewrite, remark


def test_token_rows_without_samples_row_is_a_warning(cli, run):
    rows = pq.ParquetFile(run / TOK).metadata.num_rows
    (run / SMP).unlink()
    remark(run)
    report = validate_run(run)
    assert report.ok
    w = only(report, WARNING)
    assert (w.path, w.column) == (TOK, "sample_id") and w.message.startswith(f"{rows:,} token rows reference 6 ")
    assert cli("validate", run).code == 0


def test_orphan_token_rows_are_summed_over_files_and_name_the_first(run):
    """Both ranks of step 1 lose their samples (6 completions each): one warning counts the token
    rows of both files and the 12 ids, naming the first file and the first id in it."""
    other = TOK.replace("rank=00000", "rank=00001")
    rows = sum(pq.ParquetFile(run / f).metadata.num_rows for f in (TOK, other))
    first = pq.read_table(run / TOK)["sample_id"][0].as_py()
    shutil.rmtree((run / SMP).parent)  # both ranks' samples of step 1
    remark(run)
    w = only(validate_run(run), WARNING)
    assert (w.path, w.column) == (TOK, "sample_id")
    assert w.message == (f"{rows:,} token rows reference 12 sample_id(s) with no samples row (first: {first} "
                         f"in this file); per-sample metrics (rewards, lengths) will miss them")


def test_an_orphan_id_cut_by_record_batches_is_counted_once(run, monkeypatch):
    """Token files are read in record batches: a sequence that spans two of them is one id."""
    from grpolens.run import validate

    monkeypatch.setattr(validate.validator, "_BATCH_ROWS", 7)  # smaller than a completion: every id is cut
    other = TOK.replace("rank=00000", "rank=00001")
    rows = sum(pq.ParquetFile(run / f).metadata.num_rows for f in (TOK, other))
    shutil.rmtree((run / SMP).parent)
    remark(run)
    w = only(validate_run(run), WARNING)
    assert w.message.startswith(f"{rows:,} token rows reference 12 sample_id(s) with no samples row")


def test_orphan_ids_above_every_known_id_are_counted(run):
    """The join looks each id up among the sorted known ids: an id above them all is past the end."""
    tok, smp = (f"{t}/step=00000002/rank=00001.parquet" for t in ("tokens", "samples"))
    orphans = np.unique(pq.read_table(run / tok)["sample_id"].to_numpy())
    (run / smp).unlink()
    remark(run)
    known = np.concatenate([pq.read_table(f)["sample_id"].to_numpy() for f in (run / "samples").rglob("*.parquet")])
    assert orphans.min() > known.max()
    rows = pq.ParquetFile(run / tok).metadata.num_rows
    report = validate_run(run)
    assert report.ok and only(report, WARNING).message.startswith(
        f"{rows:,} token rows reference {len(orphans)} sample_id(s) with no samples row (first: {orphans[0]} in this file)")


def test_orphan_rows_are_the_orphan_ids_own_wherever_it_sits(run):
    """The orphan id is the shard's last (after a known id); then a completion trained on again in a
    later loss call follows it (its id recurs in the shard after others): the rows counted are the
    orphan's own either way."""
    t = pq.read_table(run / TOK)
    ids = t["sample_id"].to_numpy()
    first, last = int(ids[0]), int(ids[-1])
    rewrite(run / SMP, lambda s: s.filter(pc.not_equal(s["sample_id"], last)))
    message = f"{int((ids == last).sum()):,} token rows reference 1 sample_id(s) with no samples row (first: {last} in"
    for recurs in (False, True):
        if recurs:
            again = t.filter(pc.equal(t["sample_id"], first))
            i = t.schema.get_field_index("micro_batch")
            later = pa.array(np.full(again.num_rows, pc.max(t["micro_batch"]).as_py() + 1), t.schema.field(i).type)
            pq.write_table(pa.concat_tables([t, again.set_column(i, t.schema.field(i), later)]), run / TOK)
        report = validate_run(run)
        assert report.ok and only(report, WARNING).message.startswith(message), recurs


def test_unreadable_samples_file_does_not_orphan_token_rows(run):
    (run / SMP).write_bytes(b"junk")
    p = only(validate_run(run))  # the broken file, and no spurious join warning
    assert p.path == SMP and validate_run(run).warnings == []


def test_run_without_samples_is_a_warning(run):
    shutil.rmtree(run / "samples")
    remark(run)
    report = validate_run(run)
    assert report.ok and only(report, WARNING) == Problem(
        WARNING, "samples", None, "no samples shards: rewards, lengths and groups are unknown to analysis")


def test_non_finite_values_counted_per_column(run):
    def poison(t):
        cols = {}
        for name, bad in (("logp", [np.nan, np.inf, -np.inf]), ("ref_logp", [np.nan])):
            a = t.column(name).to_numpy().copy()
            a[: len(bad)] = bad
            cols[name] = pa.array(a, pa.float32())
        for name, a in cols.items():
            t = t.set_column(t.schema.get_field_index(name), t.schema.field(name), a)
        return t
    rewrite(run / TOK, poison)
    rewrite(run / "tokens/step=00000002/rank=00001.parquet", poison)
    report = validate_run(run)
    assert report.ok
    by_col = {p.column: p for p in report.warnings}
    assert set(by_col) == {"logp", "ref_logp"}
    assert by_col["logp"].message.startswith("6 non-finite values (2 NaN, 2 +inf, 2 -inf) in 2 file(s)")
    assert by_col["ref_logp"].message.startswith("2 non-finite values (2 NaN, 0 +inf, 0 -inf)")
    assert by_col["logp"].path == TOK


def test_nulls_in_nullable_log_prob_columns_are_fine(run):
    """old_logp and ref_logp may be null (a trainer without a reference model): neither a
    non-finite value nor a positive log-prob, and no error."""
    def null_three(t):  # old_logp null in 3 rows, ref_logp in all (its statistics have no min/max)
        for name, rows in (("old_logp", 3), ("ref_logp", t.num_rows)):
            t = t.set_column(t.schema.get_field_index(name), t.schema.field(name),
                             pa.array(t.column(name).to_numpy(), pa.float32(), mask=np.arange(t.num_rows) < rows))
        return t
    rewrite(run / TOK, null_three)
    assert pq.read_table(run / TOK)["old_logp"].null_count == 3
    assert validate_run(run).problems == []
    assert check_before_reading(run).ok


def test_tokenizer_file_that_does_not_load_is_a_warning_naming_the_error(run):
    """tokenizer.json that the tokenizers library loads: no problem; one it cannot load: a warning
    with the library's first line of error, as views then show token ids."""
    tokenizers = pytest.importorskip("tokenizers")
    from grpolens.run.decode import TOKENIZER_FILE

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.save(str(run / TOKENIZER_FILE))
    assert validate_run(run).problems == []
    (run / TOKENIZER_FILE).write_text("{oops")
    with pytest.raises(Exception) as e:
        tokenizers.Tokenizer.from_file(str(run / TOKENIZER_FILE))
    first = str(e.value).splitlines()[0]
    w = only(validate_run(run), WARNING)
    assert (w.path, w.column) == (TOKENIZER_FILE, None)
    assert w.message == f"not a tokenizers JSON file ({first}): views show token ids instead of text"


def _panicking_tokenizer_json() -> str:
    """A tokenizer.json whose Precompiled normalizer holds no charsmap: the tokenizers library
    (0.23) panics in Rust while loading it, which pyo3 raises as a BaseException."""
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                       "normalizer": {"type": "Precompiled", "precompiled_charsmap": ""},
                       "pre_tokenizer": None, "post_processor": None, "decoder": None,
                       "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}})


def test_a_tokenizer_file_that_panics_the_library_is_a_warning_not_a_crash(run):
    """The library's own panic (not an ``Exception``) is a failure to load like any other: a
    warning naming its first line, from validate and from the check every reading command makes."""
    tokenizers = pytest.importorskip("tokenizers")
    from grpolens.run.decode import TOKENIZER_FILE, make_decoder

    (run / TOKENIZER_FILE).write_text(_panicking_tokenizer_json())
    with pytest.raises(BaseException) as e:  # noqa: PT011 - whatever the library raises
        tokenizers.Tokenizer.from_file(str(run / TOKENIZER_FILE))
    first = str(e.value).splitlines()[0]
    assert first
    w = only(validate_run(run), WARNING)
    assert (w.path, w.column) == (TOKENIZER_FILE, None)
    assert w.message == f"not a tokenizers JSON file ({first}): views show token ids instead of text"
    assert check_before_reading(run).ok
    assert make_decoder(run, {})[1] == "ids"  # the views show ids


def test_a_tokenizer_error_without_a_message_is_named_by_its_class(run, monkeypatch):
    """An exception without a message (Python's MemoryError when an allocation fails has none):
    the warning names its class rather than an empty pair of parentheses."""
    tokenizers = pytest.importorskip("tokenizers")
    from grpolens.run.decode import TOKENIZER_FILE

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.save(str(run / TOKENIZER_FILE))

    def no_memory(path):
        raise MemoryError()

    monkeypatch.setattr(tokenizers.Tokenizer, "from_file", staticmethod(no_memory))
    w = only(validate_run(run), WARNING)
    assert (w.path, w.column) == (TOKENIZER_FILE, None)
    assert w.message == "not a tokenizers JSON file (MemoryError): views show token ids instead of text"
