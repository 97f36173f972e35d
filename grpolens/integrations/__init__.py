"""Trainer integrations: capture real training into a grpolens run.

* :mod:`grpolens.integrations.trl`: ``GRPOLensTrainer`` / ``with_grpolens(GRPOTrainer)`` for TRL
  (imports ``trl`` and ``torch``; a test dependency of grpolens, not a core one).
* :mod:`grpolens.integrations.verl`: ``VerlCapture`` for a verl actor's ``update_policy`` (imports
  torch only; never verl).

Nothing is imported here, so ``import grpolens.integrations`` stays free.
"""
