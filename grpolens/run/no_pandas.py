"""pyarrow without pandas, for a process that only reads runs: about 0.27 s of CPU saved per process.

pyarrow looks for pandas lazily, on its first conversion of a Python or numpy value (``pa.array``,
``pa.scalar``, a compute function called with a Python number such as ``pc.less(col, 0)``): it
imports pandas then, to recognise pandas objects, and remembers what it found. A recompute never
hands pyarrow a pandas object, yet every recompute process (and each worker process) paid for the
import. :func:`pyarrow_without_pandas` lets pyarrow look once while pandas cannot be imported
(an import hook that refuses it, removed at once), so pyarrow remembers "no pandas" and converts
plain values as it does without pandas installed.

Nothing is blocked afterwards: what asks pyarrow for pandas explicitly (``Table.to_pandas``,
``Table.from_pandas``) imports it then, and pyarrow recognises pandas objects from that moment.
Until then a pandas object given to ``pa.array`` would be converted as a plain sequence, which is
why only processes that never do that opt in: ``grpolens recompute`` run as the program (not a
library caller, not a test calling :func:`grpolens.cli.main` in-process) and its worker processes.
Setting a ``None`` in ``sys.modules`` instead does not work: pyarrow's compiled import finds the
``None`` there and fails on it (a compute call with a Python number then raises).
"""

from __future__ import annotations

import sys

#: set by :func:`grpolens.cli.main` when it runs as the program (``grpolens``, ``python -m grpolens.cli``)
PROGRAM = False


class _RefusePandas:
    """An import hook under which ``import pandas`` fails as if pandas were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def pyarrow_without_pandas(*, program: bool | None = None) -> bool:
    """Have pyarrow settle, now, that pandas is absent (see the module's docstring); only in the
    program itself (``program``, default :data:`PROGRAM`). True when it did; False when pandas
    is already imported or pyarrow already looked."""
    if not (PROGRAM if program is None else program) or "pandas" in sys.modules:
        return False
    import pyarrow as pa

    hook = _RefusePandas()
    sys.meta_path.insert(0, hook)
    try:
        pa.scalar(0)  # pyarrow's first conversion: it looks for pandas here and remembers the answer
    finally:
        sys.meta_path.remove(hook)
    return "pandas" not in sys.modules
