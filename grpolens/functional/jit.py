"""Compiled per-token kernels: the one way grpolens compiles a loop over token rows.

numpy costs one pass over memory (and one temporary array) per operation, so a family that needs
a dozen sums of functions of ``logp − old`` per sequence reads every token a dozen times. A
compiled loop reads each token once and keeps the running sums in registers. :func:`kernel` is
numba's ``njit`` with the options every grpolens kernel shares, chosen once here:

* ``cache=True``: the machine code is kept beside the module (or in the user's cache directory
  when the package's folder is read-only), so only the first process after an install compiles;
* ``nogil=True``: a kernel releases the GIL, so the engine's reading threads go on meanwhile;
* ``error_model="numpy"``: a division by zero gives inf or NaN, as the numpy formulas do, never
  an exception;
* no ``fastmath``: every operation is IEEE's, in the written order, so that a kernel's value is
  what its formula says to the last bit that float64 arithmetic allows.

Kernels take and return numpy arrays and scalars only; the families call them on a
:class:`~grpolens.metrics.batch.TokenBatch`'s columns. A formula a kernel shares with numpy code
(an estimator, a bound) is written once, as a function both can call (see
:mod:`grpolens.functional.estimators`), and compiled for kernels with :func:`inline`.

numba is imported here and only here, by the engine's modules: commands that never reduce tokens
(``serve``'s pages, ``check``, ``--help``) do not pay its start-up.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import numba

F = TypeVar("F", bound=Callable)

_OPTIONS = dict(cache=True, nogil=True, error_model="numpy", fastmath=False)


def kernel(fn: F) -> F:
    """``fn`` compiled to machine code (called like ``fn``; arrays and scalars in and out)."""
    return numba.njit(**_OPTIONS)(fn)


def inline(fn: F) -> F:
    """``fn`` compiled to be called from kernels and inlined into them (a shared scalar formula)."""
    return numba.njit(inline="always", **_OPTIONS)(fn)
