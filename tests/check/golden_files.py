"""A golden file the check tests write by hand: one that reads back (``GOLDEN``), and writing any
JSON text or object as one."""

import json
from pathlib import Path


def golden_file(tmp_path, data) -> Path:
    p = tmp_path / "g.json"
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


#: a golden file of 5 steps, one metric (with NaN and ±inf), written with --set epsilon=0.1
GOLDEN = {"format": "grpolens-golden", "version": 1, "run": "runs/a", "run_name": "exp-1", "steps": [0, 1, 2, 3, 4],
          "overrides": {"epsilon": 0.1}, "metrics": {"m": {"values": {"1": 1.5, "0": "nan", "2": "inf", "3": "-inf"}}}}
