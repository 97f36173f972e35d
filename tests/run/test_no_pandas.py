"""pyarrow without pandas (grpolens/run/no_pandas.py): the recompute program and its workers skip
pandas' import, pyarrow still converts Python and numpy values, and pandas comes back on demand.
Each check runs in a fresh interpreter: pyarrow decides about pandas once per process."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_pyarrow_converts_values_without_pandas_then_imports_it_on_demand(tmp_path):
    out = _python(
        "import sys\n"
        "from grpolens.run.no_pandas import pyarrow_without_pandas\n"
        "print(pyarrow_without_pandas(program=True))\n"
        "import numpy as np, pyarrow as pa, pyarrow.compute as pc, pyarrow.parquet as pq\n"
        # a compute call with a Python number: what failed when pandas was blocked in sys.modules
        "print(pc.sum(pc.less(pa.chunked_array([[1, -2, None]]), 0)).as_py())\n"
        "print(pa.array(np.arange(3)).to_pylist() == [0, 1, 2], pa.scalar(1.5).as_py())\n"
        f"pq.write_table(pa.table({{'a': [1, 2]}}), {str(tmp_path / 'a.parquet')!r})\n"
        f"print(pq.read_table({str(tmp_path / 'a.parquet')!r}).column('a').to_pylist() == [1, 2])\n"
        "print('pandas' in sys.modules)\n"
        # asked for explicitly, pandas is imported, and pyarrow knows its objects from then on
        "df = pa.table({'a': [1, 2]}).to_pandas()\n"
        "import pandas as pd\n"
        "print(type(df).__name__, pa.types.is_dictionary(pa.array(pd.Series(pd.Categorical(['x', 'y']))).type))\n")
    assert out == ["True", "1", "True", "1.5", "True", "False", "DataFrame", "True"]


def test_only_the_program_skips_pandas():
    # a library caller or a test calling grpolens.cli.main in-process keeps pyarrow as it is
    out = _python("import sys, pyarrow as pa\n"
                  "from grpolens.run.no_pandas import pyarrow_without_pandas\n"
                  "print(pyarrow_without_pandas())\n"
                  "pa.scalar(0)\n"
                  "print('pandas' in sys.modules)\n")
    assert out == ["False", "True"]


def test_the_recompute_program_never_imports_pandas(tmp_path):
    out = _python(
        "import runpy, sys\n"
        f"sys.argv = ['grpolens', 'recompute', 'sample_runs/tiny', '--out', {str(tmp_path)!r}, '--quiet', "
        "'--workers', '1']\n"
        "try:\n    runpy.run_module('grpolens.cli', run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "print('pandas' in sys.modules)\n")
    assert out == ["False"]
    assert (tmp_path / "metrics.parquet").is_file()


def test_the_commands_that_read_a_run_never_import_pandas():
    for args in (["validate", "sample_runs/tiny"], ["tokens", "sample_runs/tiny", "--step", "1"],
                 ["completions", "sample_runs/tiny", "--step", "1"]):
        out = _python(
            "import io, runpy, sys, contextlib\n"
            f"sys.argv = ['grpolens', *{args!r}]\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n        runpy.run_module('grpolens.cli', run_name='__main__')\n"
            "    except SystemExit as e:\n        assert not e.code, e.code\n"
            "print('pandas' in sys.modules)\n")
        assert out == ["False"], args
