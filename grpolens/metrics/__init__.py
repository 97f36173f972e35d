"""Metric families. Each module registers its partial producers and its metrics on import.

Where to look for a metric: its family module has the formula (producer) and the registry entry
(doc, reduction); each trainer's name for it is in that trainer's profile table
(``grpolens/profiles/<trainer>.py``); ``tests/metrics/test_<family>.py`` has the independent reference.

This package is closed: nothing in it imports anything above it (profiles, analysis, commands),
by import or importlib. What extends it is loaded by :func:`grpolens.plugins.load_plugins`.
"""

#: Built-in family modules, imported by :func:`grpolens.metrics.registry.load_families`.
FAMILY_MODULES = [
    "health",
    "entropy",
    "rewards",
    "completions",
    "diversity",
    "policy",
    "kl",
    "clip",
    "loss",
    "rollout_is",
    "verl_actor",
    "openrlhf_actor",
    "swift_grpo",
    "twinkle",
]
