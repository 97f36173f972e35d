"""docs/doctor.md's catalogue: every detector has a row, and every threshold it quotes as
`module.NAME = value` is the constant in the code."""

import ast
import importlib
import re
from pathlib import Path

from grpolens.analysis.doctor import load_detectors

DOC = Path(__file__).resolve().parents[2] / "docs" / "doctor.md"
QUOTED = re.compile(r"`(\w+)\.([A-Z_]+) = ([^`]+)`")
MODULES = {"signals": "grpolens.analysis.doctor.signals", "context": "grpolens.analysis.doctor.context",
           "diagnose": "grpolens.analysis.doctor.diagnose"}


def test_every_detector_has_a_catalogue_row():
    text = DOC.read_text()
    rows = set(re.findall(r"^\| `([a-z-]+)` \|", text, flags=re.M))
    assert rows == set(load_detectors())


def test_quoted_thresholds_are_the_code_constants():
    quoted = QUOTED.findall(DOC.read_text())
    assert len(quoted) >= 25
    for module, name, value in quoted:
        mod = importlib.import_module(MODULES.get(module, f"grpolens.analysis.doctor.detectors.{module}"))
        assert getattr(mod, name) == ast.literal_eval(value), f"docs/doctor.md says {module}.{name} = {value}"
