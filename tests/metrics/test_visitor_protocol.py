"""The engine's Visitor: all five members recompute calls are declared, with defaults, and every
visitor class in grpolens subclasses it (recompute calls them without probing with hasattr)."""

import ast
from pathlib import Path

from grpolens.metrics.engine import Visitor

ROOT = Path(__file__).resolve().parents[2] / "grpolens"


def test_the_optional_members_have_defaults():
    class Counter(Visitor):
        name = "tests-counter"

        def shard(self, batch, shard):
            return 1

        def combine(self, step, pieces):
            return sum(pieces)

    v = Counter()
    assert v.collect is False
    assert v.at_step(3, {"piece": 1}, None, None) == {"piece": 1}
    assert v.finish(None, None, {}, set()) is None
    assert v.combine(0, [v.shard(None, None)] * 3) == 3


def test_shard_and_combine_must_be_given():
    import pytest

    class Bare(Visitor):
        name = "tests-bare"

    with pytest.raises(NotImplementedError):
        Bare().shard(None, None)
    with pytest.raises(NotImplementedError):
        Bare().combine(0, [])


def test_every_visitor_class_in_grpolens_subclasses_visitor():
    """A class with both ``shard`` and ``combine`` methods is a visitor: it names Visitor as a base."""
    loose = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or node.name == "Visitor":
                continue
            methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
            if {"shard", "combine"} <= methods and "Visitor" not in bases:
                loose.append(f"{path.relative_to(ROOT.parent)}:{node.name}")
    assert not loose, f"visitors that do not subclass grpolens.metrics.engine.Visitor: {loose}"
