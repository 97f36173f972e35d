"""docs/architecture.md's layer table names every top-level module and package of grpolens, in the
order of the layers that tests/test_import_graph.py enforces: a new package, or a layer moved in
the import-graph test, fails here until the page says where it sits."""

import re
from pathlib import Path

from tests.test_import_graph import LAYERS

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def _table_rows() -> list[str]:
    section = DOC.split("| layer, lowest first |", 1)[1].split("\n\n", 1)[0]
    return [line for line in section.splitlines()[2:] if line.startswith("|")]


def _top_level() -> list[str]:
    pkg = ROOT / "grpolens"
    names = [p.name for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    names += [p.stem for p in pkg.glob("*.py") if p.stem != "__init__"]
    return sorted(names)


def _row_of(module: str, rows: list[str]) -> int | None:
    short = module.removeprefix("grpolens.")
    pattern = re.compile(rf"grpolens/{re.escape(short)}(/|\.py)|`{re.escape(short)}\.py`")
    hits = [i for i, row in enumerate(rows) if pattern.search(row.split("|")[2])]
    return hits[0] if hits else None


def test_every_top_level_module_and_package_is_placed_in_a_layer():
    rows = _table_rows()
    missing = [n for n in _top_level() if _row_of(f"grpolens.{n}", rows) is None]
    assert not missing, f"docs/architecture.md's layer table does not place: {', '.join(missing)}"


def test_the_table_lists_the_layers_in_the_import_graph_order():
    rows = _table_rows()
    placed = []
    for layer in LAYERS:
        found = {_row_of(m, rows) for m in layer} - {None}
        assert len(found) == 1, f"{layer}: expected in exactly one row of docs/architecture.md, found rows {found}"
        placed.append(found.pop())
    assert placed == sorted(placed), "docs/architecture.md lists the layers out of the import-graph order"
