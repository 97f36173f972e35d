"""Trainer profiles: one module per trainer, each registering one :class:`~grpolens.metrics.profile.Profile`.

A profile module holds everything trainer-specific: its names table (canonical metric -> the
trainer's key), its token-mean grouping, its own reductions where the trainer reduces differently,
what it logs as 0.0, its rollout-IS summary, its log file and float32 floors for ``grpolens parity``.
Profiles import the metric families they adjust; families never import profiles. Adding a trainer is
adding a module here (plus its test and the regenerated docs): the module is found by
:func:`builtin_names` and loaded by :func:`grpolens.plugins.load_plugins`.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

#: The default profile, listed first; the others follow alphabetically.
DEFAULT = "grpolens"


def builtin_names() -> list[str]:
    """The built-in profile modules (without importing them: ``grpolens --help`` stays light)."""
    names = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if not m.name.startswith("_"))
    return sorted(names, key=lambda n: n != DEFAULT)


def profile_help(what: str = "Names and reductions") -> str:
    """``--profile`` help text naming the built-in profiles (found without importing them, so that
    the CLI starts without numpy); installed plugins may add more."""
    return f"{what}: {', '.join(builtin_names())} (see docs/profiles.md)."
