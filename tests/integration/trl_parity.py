"""Compare ``recompute(run, profile="trl")`` (:mod:`grpolens.analysis.parity`) with what TRL itself logged in the run
(``RUN/grpolens/trl_log.jsonl``, written by the integration); a test helper and a script.

The product command is ``grpolens parity RUN``; the integration tests use the same comparison.
Both sides use TRL's ``step`` (the integration records ``state.global_step + 1``, the step TRL logs).

As a script, it trains the test configurations with the TRL that Python imports (put an older
release first on ``PYTHONPATH`` to check it) and prints, per configuration, the values reproduced
out of the values TRL logged::

    python tests/integration/trl_parity.py --matrix                 # every configuration
    python tests/integration/trl_parity.py --matrix defaults,window_ddp
    python tests/integration/trl_parity.py RUN [RUN ...]            # runs recorded already
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from grpolens.analysis.parity import RTOL, Row, compare as _compare, read_log, summary  # noqa: E402,F401 (re-exported)


def trl_log(run: Path) -> dict[int, dict]:
    """Step -> TRL's logged values (the end-of-training summary at its step)."""
    return read_log(Path(run) / "grpolens" / "trl_log.jsonl")


def compare(run: Path, *, rel: float = RTOL) -> list[Row]:
    return _compare(run, profile="trl", rtol=rel)


def _count(run: Path) -> tuple[int, int, list[Row]]:
    rows = compare(run)
    return sum(r.status == "ok" for r in rows), len(rows), [r for r in rows if r.status != "ok"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="TRL parity: values reproduced / values TRL logged.")
    p.add_argument("runs", nargs="*", type=Path, help="recorded runs to compare")
    p.add_argument("--matrix", nargs="?", const="all", help="train these configurations (comma-separated "
                   "names from trl_tiny.CONFIGS, or all) and compare each")
    a = p.parse_args(argv)
    results = [(str(r), *_count(r)) for r in a.runs]
    if a.matrix:
        import trl

        from tests.integration import trl_tiny
        from tests.integration.conftest import train_in_process, train_torchrun

        names = list(trl_tiny.CONFIGS) if a.matrix == "all" else a.matrix.split(",")
        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                out = Path(tmp) / name
                (train_torchrun if "ddp" in name else train_in_process)(out, trl_tiny.CONFIGS[name])
                results.append((f"trl {trl.__version__} {name}{' (2 processes)' if 'ddp' in name else ''}",
                                *_count(out / "run")))
                print(f"{results[-1][0]}: {results[-1][1]}/{results[-1][2]}", file=sys.stderr, flush=True)
    if not results:
        p.error("name runs or --matrix")
    ok = logged = 0
    for where, good, total, bad in results:
        print(f"{good:4d}/{total:<4d} {where}")
        for r in bad:
            print(f"          {r}")
        ok, logged = ok + good, logged + total
    print(f"{ok}/{logged} logged values reproduced")
    return 0 if ok == logged else 1


if __name__ == "__main__":
    sys.exit(main())
