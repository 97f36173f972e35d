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

numba is imported here and only here, and only when a kernel is first called (or inspected): a
module defining kernels imports at no cost (numba's import is ~0.23 s of CPU), so commands that
load the families but never reduce tokens (``metrics``, ``check``, ``serve``'s pages, ``--help``)
do not pay it. Until then :func:`kernel` and :func:`inline` return a stand-in; the first call of
any stand-in compiles them all (numba's ``njit``, which itself compiles at a kernel's first call)
and puts each dispatcher where its stand-in was, in every loaded module's globals, so that a
kernel calling an inlined formula (a global of its module, or of a module it names) finds numba's
object there, as it would had numba compiled at import. Kernels defined after that are numba's
dispatchers at once.
"""

from __future__ import annotations

import sys
import threading
from types import MethodType
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable)

_OPTIONS = dict(cache=True, nogil=True, error_model="numpy", fastmath=False)

_pending: list["_Deferred"] = []  # stand-ins not yet compiled
_first_compile: list[Callable[[], None]] = []  # on_first_compile's callbacks, until one compile happens
_lock = threading.Lock()
_numba: Any = None  # the module, once imported


def kernel(fn: F) -> F:
    """``fn`` compiled to machine code (called like ``fn``; arrays and scalars in and out)."""
    return _compiled(fn, _OPTIONS)


def inline(fn: F) -> F:
    """``fn`` compiled to be called from kernels and inlined into them (a shared scalar formula)."""
    return _compiled(fn, dict(inline="always", **_OPTIONS))


def on_first_compile(callback: Callable[[], None]) -> None:
    """Have ``callback()`` called once, just before this process first compiles a kernel because
    numba's cache has none for it: the first recompute after an install or an upgrade, which
    compiles the engine's kernels (~15 s of CPU) where later runs load them (~0.1 s). A command
    says so, rather than seeming to hang. Loading a cached kernel calls nothing."""
    with _lock:
        _first_compile.append(callback)


def _announce_first_compile(numba) -> None:
    """Listen for numba's compile event (sent only when no cached machine code was found) and call
    the :func:`on_first_compile` callbacks at the first one."""
    from numba.core import event

    class FirstCompile(event.Listener):
        def on_start(self, ev):
            with _lock:
                todo = list(_first_compile)
                _first_compile.clear()
            for callback in todo:
                callback()

        def on_end(self, ev):
            pass

    event.register("numba:compile", FirstCompile())


def _compiled(fn, options: dict):
    if _numba is not None:
        return _numba.njit(**options)(fn)
    stand_in = _Deferred(fn, options)
    _pending.append(stand_in)
    return stand_in


class _Deferred:
    """A kernel before numba is imported: called (or asked for an attribute, e.g. ``targetoptions``)
    it has every pending kernel compiled and answers as its numba dispatcher."""

    def __init__(self, fn, options: dict):
        self.py_func, self.options, self.dispatcher = fn, options, None
        self.__name__, self.__qualname__, self.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
        self.__module__, self.__wrapped__ = fn.__module__, fn

    def __call__(self, *args, **kwargs):
        return (self.dispatcher if self.dispatcher is not None else _load_numba(self))(*args, **kwargs)

    def __get__(self, obj, objtype=None):  # a kernel as a class attribute binds as numba's does
        return self if obj is None else MethodType(self, obj)

    def __getattr__(self, name: str):
        # only for names the instance lacks: numba's own, ``_numba_type_`` among them, so that a
        # stand-in numba meets where none was swapped (a closure's cell) types as its dispatcher
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dispatcher if self.dispatcher is not None else _load_numba(self), name)

    def __repr__(self) -> str:
        return f"<kernel {self.__module__}.{self.__qualname__} (not compiled yet)>"


def _load_numba(caller: _Deferred):
    """Import numba, make every pending stand-in's dispatcher, and put the dispatchers in place of
    the stand-ins in the loaded modules' globals; returns ``caller``'s dispatcher."""
    global _numba
    with _lock:  # two threads calling their first kernels at once: numba is loaded once
        if _numba is None:
            import numba

            _without_scipy_blas()
            _announce_first_compile(numba)
            for d in _pending:
                d.dispatcher = numba.njit(**d.options)(d.py_func)
            swap = {id(d): d.dispatcher for d in _pending}
            for mod in list(sys.modules.values()):
                names = getattr(mod, "__dict__", None)
                if isinstance(names, dict):
                    for k, v in list(names.items()):
                        if type(v) is _Deferred and id(v) in swap:
                            names[k] = swap[id(v)]
            _pending.clear()
            _numba = numba
    return caller.dispatcher


class _RefuseScipyLinalg:
    """An import hook under which ``import scipy.linalg...`` fails as if scipy were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "scipy.linalg" or name.startswith("scipy.linalg."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def _without_scipy_blas() -> None:
    """Load numba's numpy implementations without scipy's BLAS. On its first compile (a cached
    kernel's load included) numba imports ``numba.np.arraymath``, which imports
    ``scipy.linalg.cython_blas`` where scipy is installed, only to decide whether ``np.correlate``
    and ``np.convolve`` in a kernel use BLAS' dot (~0.15 s of CPU per process, each worker's
    included). No grpolens kernel calls them, so numba records "no BLAS" for those two (its loop
    instead); linear algebra in a kernel would still import scipy when compiled."""
    if "numba.np.arraymath" in sys.modules or "scipy.linalg" in sys.modules:
        return
    hook = _RefuseScipyLinalg()
    sys.meta_path.insert(0, hook)
    try:
        import numba.np.arraymath  # noqa: F401 - imported now, under the hook
    finally:
        sys.meta_path.remove(hook)
