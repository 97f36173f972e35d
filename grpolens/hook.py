"""Public import path of the capture hook: ``from grpolens.hook import GRPOLensHook``.

The hook lives in :mod:`grpolens.capture.hook` (the capture layer, next to its writer); this module
keeps the path users write working.
"""

from grpolens.capture.hook import GRPOLensHook

__all__ = ["GRPOLensHook"]
