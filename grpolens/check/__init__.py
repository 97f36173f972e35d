"""``grpolens check``: CI gates on recomputed metrics.

A rules file (or the built-in defaults) says, per metric, which steps to look at, how to reduce
them and what bounds the result must keep: absolute (``min``, ``max``, ``finite``), relative to
the run's own first steps (``early``), or against a baseline run or golden file (``abs``/``rel``).

    from grpolens.check import check
    report = check("runs/candidate", baseline="golden.json")
    report.exit_code          # 0 pass, 1 regression, 2 bad input

Modules: :mod:`.rules` (rule model and file parsing), :mod:`.evaluate` (one rule on per-step
series), :mod:`.baseline` (baseline runs and golden files), :mod:`.defaults` (the built-in
rules and why), :mod:`.runner` (the check itself), :mod:`.report` (table, JUnit, GitHub, Markdown).
"""

from grpolens.check.runner import CheckReport, check

__all__ = ["check", "CheckReport"]
