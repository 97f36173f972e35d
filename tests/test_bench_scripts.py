"""The benchmark scripts measure what they say they measure."""

import importlib.util
from pathlib import Path

from grpolens.metrics.engine import READ_COLUMNS

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_read_floor_reads_the_columns_recompute_reads():
    # read_floor.py spells the list out so that its process imports no grpolens
    assert tuple(_load("read_floor").TOKEN_COLUMNS) == tuple(READ_COLUMNS)


def test_subset_is_a_valid_only_selection():
    from grpolens.analysis.recompute import metrics_for, select_metrics
    from grpolens.run.config import check_config

    subset = _load("bench_recompute").SUBSET
    from grpolens.run import format as fmt

    cfg = check_config(fmt.read_manifest(BENCH.parent / "sample_runs" / "tiny").resolved_config())
    picked = select_metrics(metrics_for("grpolens", cfg), [subset])
    assert [m.name for m in picked] and len(picked) == len(subset.split(","))
