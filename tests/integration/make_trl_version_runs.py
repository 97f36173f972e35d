"""Record the runs in ``tests/data/trl-<version>/``: real training with an older TRL release.

TRL's aggregation rules changed over releases (per-rank means and rank-level ``low_min`` /
``high_max`` before 1.9; ``log()`` keeping NaN before 1.0; the dapo normaliser's ``G/S`` from 1.10).
The suite's TRL is the newest; these runs were trained by the older releases' own code, through the
integration, so that ``tests/integration/test_trl_versions.py`` checks the trl profile's rules for
them without installing them. To re-record one, put that release beside the installed torch and
transformers and run this script with it first on the path::

    pip install --no-deps --target /tmp/trl-1.8.0 trl==1.8.0
    PYTHONPATH=/tmp/trl-1.8.0:. python tests/integration/make_trl_version_runs.py

Cases (from ``trl_tiny.CONFIGS``): ``window_ddp`` (two processes under torchrun, clipping, logging
windows) and ``defaults`` (GRPOConfig's defaults, logging_steps=10). Only the grpolens run is kept:
tokens, samples, manifest, TRL's log and the Trainer's schedule (no text, no weights).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = {"window_ddp": 2, "defaults": 1}
KEEP = ("trl_log.jsonl", "trl_state.json")


def main() -> None:
    import trl

    sys.path.insert(0, str(ROOT))
    from tests.integration import trl_tiny
    from tests.integration.conftest import _free_port

    target_root = ROOT / "tests" / "data" / f"trl-{trl.__version__}"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(trl.__file__).parents[1]), str(ROOT)])}
    for case, nproc in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out"  # relative on the command line: no temporary path in the manifest
            args = [*trl_tiny.CONFIGS[case], "--no-text", "--run-name", f"trl-{trl.__version__}-{case}"]
            if nproc == 1:
                cmd = [sys.executable, str(ROOT / "tests" / "integration" / "trl_tiny.py"), "out", *args]
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                       "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                       str(ROOT / "tests" / "integration" / "trl_tiny.py"), "out", *args]
            subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=tmp)
            target = target_root / case
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(out / "run", target,
                            ignore=lambda d, names: [n for n in names if Path(d).name == "grpolens" and n not in KEEP])
            size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
            print(f"wrote {target} ({size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
