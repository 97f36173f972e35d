"""Trainer integrations: capture real training into a grpolens run.

* :mod:`grpolens.integrations.trl`: ``GRPOLensTrainer`` / ``with_grpolens(GRPOTrainer)`` for TRL
  (imports ``trl`` and ``torch``; a test dependency of grpolens, not a core one).
* :mod:`grpolens.integrations.verl`: ``VerlCapture`` for a verl actor's ``update_policy`` (imports
  torch only; never verl).
* :mod:`grpolens.integrations.openrlhf`: ``OpenRLHFCapture`` for OpenRLHF's actor and experience
  maker (imports torch only; never OpenRLHF).
* :mod:`grpolens.integrations.swift`: ``SwiftCapture`` for ms-swift's GRPO trainer (imports torch
  only; never ms-swift).

Nothing is imported here, so ``import grpolens.integrations`` stays free.
"""

from typing import Any


def trainer_info(name: str) -> dict[str, Any]:
    """The manifest's ``trainer`` entry: the trainer's distribution name and its installed version
    (None where it is not installed, as in a test that drives the trainer's code from elsewhere)."""
    from importlib import metadata

    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        version = None
    return {"name": name, "version": version}
