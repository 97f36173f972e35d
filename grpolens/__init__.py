"""grpolens: keep the tokens of a GRPO-family training run and recompute every metric offline, exactly.

The analysis API is imported lazily so that ``import grpolens`` stays cheap and never imports torch::

    import grpolens
    df = grpolens.recompute("sample_runs/tiny")   # polars.DataFrame, one row per step
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["recompute", "__version__"]


def __getattr__(name: str):
    if name == "recompute":
        from grpolens.analysis.recompute import recompute

        return recompute
    raise AttributeError(f"module 'grpolens' has no attribute {name!r}")
