"""Metric families. Each module registers its partial producers and its metrics on import.

Where to look for a metric: its family module has the formula (producer) and the registry entry
(names per profile, doc); ``tests/metrics/test_<family>.py`` has the independent reference.
"""

#: Built-in family modules, imported by :func:`grpolens.metrics.registry.load_builtins`.
FAMILY_MODULES = [
    "health",
    "entropy",
    "rewards",
    "lengths",
    "diversity",
    "policy",
    "kl",
    "clip",
    "loss",
    "rollout_is",
]

#: Other modules that register producers or visitors (imported after the families).
EXTRA_MODULES = [
    "grpolens.analysis.drilldown",
    "grpolens.analysis.sidecars",
]
