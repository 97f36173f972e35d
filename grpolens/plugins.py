"""Loading what extends the metrics layer: trainer profiles, output visitors, third-party plugins.

The metrics layer (:mod:`grpolens.metrics`) is closed: it imports nothing above it. What plugs into
its registries -- trainer profiles (``grpolens/profiles/<trainer>.py``), visitors that write outputs
during a recompute (top tokens, the completions table) and any third-party family or profile -- is
imported from here, the built-ins exactly as a plugin is (as datasette loads its own): a module
that registers itself on import.

A third-party package adds a metric family or a profile without editing grpolens by declaring an
entry point in the ``grpolens.plugins`` group, e.g. in its ``pyproject.toml``::

    [project.entry-points."grpolens.plugins"]
    openrlhf_extra = "my_package.grpolens_profile"

The module registers metrics with :func:`grpolens.metrics.registry.register`, producers with
:func:`grpolens.metrics.partials.producer`, visitors (subclasses of
:class:`grpolens.metrics.engine.Visitor`) with :func:`grpolens.metrics.engine.visitor`, profiles
with :func:`grpolens.metrics.profile.register_profile` and tracker exporters (``grpolens export
--to``) with :func:`grpolens.export.base.register_exporter`.
"""

from __future__ import annotations

import importlib

from grpolens.errors import UserError
from grpolens.metrics.profile import PROFILES, Profile
from grpolens.metrics.registry import REGISTRY, Metric, apply_profiles, load_families

ENTRY_POINT_GROUP = "grpolens.plugins"

#: Built-in plugins besides the profiles (``grpolens/profiles/*.py``, found by listing the package).
BUILTIN_VISITORS = (
    "grpolens.analysis.drilldown",  # the top-tokens visitor
    "grpolens.analysis.sidecars",  # the completions-table visitor
    "grpolens.analysis.is_weights",  # the IS-weight histograms (is_hist.parquet)
)


def builtin_modules() -> list[str]:
    from grpolens.profiles import builtin_names

    return [*(f"grpolens.profiles.{p}" for p in builtin_names()), *BUILTIN_VISITORS]

_loaded = False


def _entry_point_modules() -> list[str]:
    from importlib import metadata

    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # noqa: BLE001 - broken distribution metadata must not break grpolens
        return []
    return [ep.value.split(":", 1)[0] for ep in eps]


def load_plugins() -> dict[str, Metric]:
    """Load the metric families, the built-in plugins and the installed ``grpolens.plugins``
    entry points (once), and give every metric its profile names. Returns the metric registry."""
    global _loaded
    load_families()
    if not _loaded:
        for mod in (*builtin_modules(), *_entry_point_modules()):
            importlib.import_module(mod)
        load_families()  # a plugin's metrics sort after the built-in families
        _loaded = True
    apply_profiles()
    return REGISTRY


def profiles() -> dict[str, Profile]:
    """Every registered profile, name -> profile (loads the plugins)."""
    load_plugins()
    return PROFILES


def get(name: str, option: str = "--profile") -> Profile:
    """The profile ``name``; a one-line UserError naming the choices otherwise."""
    load_plugins()
    if name not in PROFILES:
        raise UserError(f"{option}: unknown profile {name!r}; choose one of {', '.join(PROFILES)}")
    return PROFILES[name]

