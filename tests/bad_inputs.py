"""The bad-input corpus: every way a run can lie that grpolens must refuse, in one place.

Each :class:`Case` damages a copy of a good run and says what ``grpolens validate`` names (the file
relative to the run, the column, a part of the message). ``tests/test_bad_inputs.py`` runs each
through validate *and* through the commands that read the run (recompute first), which must refuse
with the same message: the footers (statistics) may save work, never be the only guard. ``OK``
holds the neighbours on the good side of each bound: moving a bound by one fails one side.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from tests.parquet_footer import set_statistics

TOK = "tokens/step=00000001/rank=00000.parquet"
SMP = "samples/step=00000001/rank=00000.parquet"
MANIFEST = "grpolens.json"
MAX_LEN = 16  # the synthetic run's max_completion_length (conftest-free: see make_good_run)


def make_good_run(path: Path) -> Path:
    from grpolens.adapters.synth import synth_run

    return synth_run(path, steps=3, ranks=1, groups=2, generations=3, max_len=MAX_LEN, seed=1, texts=True)


@dataclass(frozen=True)
class Case:
    breaks: Callable[[Path], None]
    path: str  # what validate names, relative to the run
    column: str | None
    message: str  # part of validate's (and every reader's) message


def _rewrite(run: Path, rel: str, column: str, fn) -> int:
    """Replace ``column`` of ``run/rel`` by ``fn(values)``; returns the column's index in the file."""
    t = pq.read_table(run / rel)
    i = t.schema.get_field_index(column)
    field = t.schema.field(i).with_nullable(True)  # a foreign writer's schema may allow nulls anywhere
    t = t.set_column(i, field, pa.array(fn(t[column].to_pylist()), field.type))
    pq.write_table(t, run / rel)
    return pq.ParquetFile(run / rel).schema_arrow.get_field_index(column)


def _first(value):
    return lambda values: [value, *values[1:]]


def _manifest(run: Path, edit) -> None:
    m = json.loads((run / MANIFEST).read_text())
    edit(m)
    (run / MANIFEST).write_text(json.dumps(m))


def _config(**values):
    return lambda run: _manifest(run, lambda m: m["config"].update(values))


def _top(**values):
    return lambda run: _manifest(run, lambda m: m.update(values))


# -- lying footers: the statistics say the values are fine ------------------------------------
def positive_logp_under_a_lowered_max(run: Path) -> None:
    """20 positive log-probs; the footer's maximum lowered to a plausible -0.01."""
    i = _rewrite(run, TOK, "logp", lambda v: [3.0] * 20 + v[20:])
    set_statistics(run / TOK, i, max_value=struct.pack("<f", -0.01))


def null_advantage_under_a_zero_null_count(run: Path) -> None:
    i = _rewrite(run, TOK, "advantage", _first(None))
    set_statistics(run / TOK, i, null_count=0)


def negative_pos_under_a_raised_min(run: Path) -> None:
    """Every position minus 10,000 (order and uniqueness kept); the footer's minimum says 0."""
    i = _rewrite(run, TOK, "pos", lambda v: [p - 10_000 for p in v])
    set_statistics(run / TOK, i, min_value=struct.pack("<i", 0))


def negative_completion_len_under_a_raised_min(run: Path) -> None:
    i = _rewrite(run, SMP, "completion_len", _first(-5))
    set_statistics(run / SMP, i, min_value=struct.pack("<i", 1))


def long_completion_under_a_lowered_max(run: Path) -> None:
    i = _rewrite(run, SMP, "completion_len", _first(MAX_LEN + 1))
    set_statistics(run / SMP, i, max_value=struct.pack("<i", MAX_LEN))


# -- nonsense as data --------------------------------------------------------------------------
def _rename(run: Path, rel: str, new_name: str) -> None:
    os.rename(run / rel, (run / rel).parent / new_name)


def _manifest_nested(depth: int):
    def breaks(run: Path) -> None:
        text = (run / MANIFEST).read_text()
        (run / MANIFEST).write_text(text.replace('"config": {', '"deep": ' + "[" * depth + "]" * depth + ', "config": {', 1))
    return breaks


NEGATIVE = "negative values (must be >= 0)"
CASES: dict[str, Case] = {
    # class 3: lying footers
    "positive_logp_under_a_lowered_max": Case(positive_logp_under_a_lowered_max, TOK, "logp", "20 positive log-probabilities"),
    "null_under_a_zero_null_count": Case(null_advantage_under_a_zero_null_count, TOK, "advantage",
                                         "1 null values in a non-nullable column"),
    "negative_pos_under_a_raised_min": Case(negative_pos_under_a_raised_min, TOK, "pos", NEGATIVE),
    "negative_completion_len_under_a_raised_min": Case(negative_completion_len_under_a_raised_min, SMP,
                                                       "completion_len", NEGATIVE),
    "long_completion_under_a_lowered_max": Case(long_completion_under_a_lowered_max, SMP, "completion_len",
                                                f"1 completions longer than the manifest's max_completion_length {MAX_LEN}"),
    # class 4: nonsense as data
    "completion_len_int32_min": Case(lambda r: _rewrite(r, SMP, "completion_len", _first(-2**31)), SMP,
                                     "completion_len", NEGATIVE),
    "completion_len_minus_one": Case(lambda r: _rewrite(r, SMP, "completion_len", _first(-1)), SMP, "completion_len", NEGATIVE),
    "completion_len_max_plus_one": Case(lambda r: _rewrite(r, SMP, "completion_len", _first(MAX_LEN + 1)), SMP,
                                        "completion_len", f"(first: {MAX_LEN + 1} tokens)"),
    "prompt_len_negative": Case(lambda r: _rewrite(r, SMP, "prompt_len", _first(-1)), SMP, "prompt_len", NEGATIVE),
    "group_id_negative": Case(lambda r: _rewrite(r, SMP, "group_id", _first(-1)), SMP, "group_id", NEGATIVE),
    "arabic_indic_step_folder": Case(lambda r: _rename(r, "tokens/step=00000001", "step=" + "\u0660" * 7 + "\u0661"),
                                     "tokens/step=\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661", None,
                                     "stray entry: expected a directory step=<8 digits>"),
    "fullwidth_rank_file": Case(lambda r: _rename(r, TOK, "rank=\uff10\uff10\uff10\uff10\uff10.parquet"),
                                "tokens/step=00000001/rank=\uff10\uff10\uff10\uff10\uff10.parquet", None,
                                "stray file: expected rank=<5 digits>"),
    # class 2: counts the format cannot honour
    "world_size_a_billion": Case(_top(world_size=10**9), MANIFEST, None,
                                 "'world_size' must be an integer from 1 to 100,000 (ranks are written as 5 digits)"),
    "world_size_one_past_5_digits": Case(_top(world_size=100_001), MANIFEST, None, "got 100001"),
    "world_size_zero": Case(_top(world_size=0), MANIFEST, None, "'world_size' must be an integer from 1 to 100,000"),
    "run_name_not_a_string": Case(_top(run_name=["a"]), MANIFEST, None, "'run_name' must be a string, got ['a']"),
    # class 5: one config schema
    "beta_infinite": Case(_config(beta=float("inf")), MANIFEST, None, "config key 'beta': must be finite, got inf"),
    "beta_nan": Case(_config(beta=float("nan")), MANIFEST, None, "config key 'beta': must not be NaN"),
    "beta_negative": Case(_config(beta=-0.01), MANIFEST, None, "config key 'beta': must be >= 0.0"),
    "epsilon_negative": Case(_config(epsilon=-0.5), MANIFEST, None, "config key 'epsilon': must be >= 0.0, got -0.5"),
    "epsilon_above_one": Case(_config(epsilon=1.001), MANIFEST, None, "config key 'epsilon': must be <= 1.0, got 1.001"),
    "epsilon_high_infinite": Case(_config(epsilon_high=float("inf")), MANIFEST, None, "config key 'epsilon_high': must be finite"),
    "loss_type_path": Case(_config(loss_type="../../x"), MANIFEST, None, "config key 'loss_type': must be one of grpo"),
    "num_generations_past_int32": Case(_config(num_generations=2**31), MANIFEST, None,
                                       "config key 'num_generations': must be an integer from 1 to 2,147,483,647"),
    "temperature_zero": Case(_config(temperature=0), MANIFEST, None, "config key 'temperature': must be > 0.0"),
    # class 9: no tracebacks
    "manifest_nested_100000_deep": Case(_manifest_nested(100_000), MANIFEST, None, "manifest is nested too deeply"),
    "vocab_file_nul_byte": Case(_config(vocab_file="vocab\x00.json"), MANIFEST, None,
                                "holds a control character (a NUL byte?)"),
}

#: The good side of each bound: validate passes and recompute runs.
OK: dict[str, Callable[[Path], None]] = {
    "completion_len_at_max": lambda r: _rewrite(r, SMP, "completion_len", _first(MAX_LEN)),
    "completion_len_zero": lambda r: _rewrite(r, SMP, "completion_len", _first(0)),
    "epsilon_one": _config(epsilon=1.0),
    "beta_zero": _config(beta=0.0),
    "num_generations_int32_max": _config(num_generations=2**31 - 1),
    "manifest_nested_50_deep": _manifest_nested(50),
    "logp_at_tolerance": lambda r: _rewrite(r, TOK, "logp", _first(1e-3)),
}
