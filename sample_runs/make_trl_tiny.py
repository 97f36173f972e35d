"""Regenerate ``sample_runs/trl-tiny/``: a run recorded from real TRL GRPOTrainer training on CPU.

    python sample_runs/make_trl_tiny.py          # from the repository root; needs the dev extra (trl)

TRL 1.16's GRPOTrainer trains a tiny random Qwen2 (2 layers, hidden 64) with a locally trained BPE
tokenizer for 24 optimizer steps through ``grpolens.integrations.trl.GRPOLensTrainer`` (the setup of
``tests/integration/trl_tiny.py``: loss ``dapo``, 2 micro-batches per step, ``num_iterations=2``,
``beta=0.04``, ``epsilon=0.05/0.08``, ``lr=1e-4``, 16 completions of at most 24 tokens per
generation), so clipping, KL and truncation all happen, and TRL's default ``logging_steps=10``: TRL
logs at steps 10 and 20, each the mean over its 10-step window, and the last 4 steps with its
end-of-training summary. TRL's own logged metrics are in ``trl-tiny/grpolens/trl_log.jsonl``;
``grpolens parity sample_runs/trl-tiny`` reproduces every one of them. The weights are not kept (the
run does not need them); the integration saves the tokenizer as ``tokenizer.json`` in the run, so
that the views show token text.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = HERE / "trl-tiny"
ARGS = ["--max-steps", "24", "--max-completion-length", "24", "--logging-steps", "10", "--run-name", "trl-tiny",
        "--seed", "0"]


def main() -> None:
    sys.path.insert(0, str(HERE.parent))
    from tests.integration import trl_tiny

    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # relative paths only, so that no temporary path ends up in the manifest
        try:
            trl_tiny.main(["out", *ARGS])
        finally:
            os.chdir(cwd)
        run = Path(tmp) / "out" / "run"
        if TARGET.exists():
            shutil.rmtree(TARGET)
        shutil.copytree(run, TARGET)
    size = sum(f.stat().st_size for f in TARGET.rglob("*") if f.is_file())
    print(f"wrote {TARGET} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
