"""Robust colour scales: a single huge value does not wash out every other cell."""

from __future__ import annotations

import numpy as np
import polars as pl

from grpolens.serve.components import _SHADES, diverging_cell_styles, robust_scale


def shade_of(styles: list[dict], column: str, value: float) -> str | None:
    """Evaluate the styles' filter queries on one value (they only use >, >=, <, <= and &&)."""
    import operator
    import re

    ops = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
    hits = []
    for s in styles:
        if s["if"]["column_id"] != column:
            continue
        ok = True
        for clause in s["if"]["filter_query"].split(" && "):
            m = re.fullmatch(r"\{(.+)\} (>=|<=|>|<) (.+)", clause)
            assert m and m.group(1) == column, clause
            ok &= ops[m.group(2)](value, float(m.group(3)))
        if ok:
            hits.append(s["backgroundColor"])
    assert len(hits) <= 1, (value, hits)  # the shades do not overlap
    return hits[0] if hits else None


def test_a_huge_value_does_not_swamp_the_scale():
    rng = np.random.default_rng(0)
    normal = list(rng.uniform(-1, 1, 200))
    values = normal + [1.4e16]  # mismatch/chi2_seq-sized
    assert robust_scale(values) < 2  # the 99th percentile ignores the outlier
    styles = diverging_cell_styles(pl.DataFrame({"d": values}), ["d"])
    shades = {shade_of(styles, "d", v) for v in normal}
    assert len(shades) == 2 * len(_SHADES)  # the ordinary values use every shade of both signs
    assert shade_of(styles, "d", 1.4e16) == shade_of(styles, "d", max(normal))  # clipped to the top shade
    assert shade_of(styles, "d", -0.999) != shade_of(styles, "d", -0.01)
    assert shade_of(styles, "d", 0.0) is None


def test_no_finite_values_no_styles():
    assert diverging_cell_styles(pl.DataFrame({"d": [None, float("nan"), float("inf")]}), ["d"]) == []
    assert robust_scale([0.0, 0.0]) is None
