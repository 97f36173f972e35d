"""``grpolens explain``: why a metric moved between two steps, decomposed exactly.

The pieces, each in its own module:

* :mod:`~grpolens.analysis.explain.terms`: one step's per-sequence partials and the same producers
  evaluated per token;
* :mod:`~grpolens.analysis.explain.reductions`: the metric's reduction as a linear form (or an
  extremum), found by probing the profile's own reduction;
* :mod:`~grpolens.analysis.explain.dimensions`: the keys of each dimension;
* :mod:`~grpolens.analysis.explain.decompose`: contributions, mix/rate, concentration;
* :mod:`~grpolens.analysis.explain.model`: the :class:`Explanation`, its ``--json`` object and headline;
* :mod:`~grpolens.analysis.explain.render`: rich tables for the terminal.
"""

from grpolens.analysis.explain.api import explain, parse_baseline
from grpolens.analysis.explain.dimensions import DIMENSIONS
from grpolens.analysis.explain.model import Explanation

__all__ = ["explain", "parse_baseline", "Explanation", "DIMENSIONS"]
