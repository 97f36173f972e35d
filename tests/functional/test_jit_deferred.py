"""numba is imported at a kernel's first call, not when a module defining kernels is imported
(grpolens/functional/jit.py): commands that load the families but reduce no tokens skip its
~0.23 s. Fresh interpreters: the first call happens once per process."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, tmp_path=None) -> list[str]:
    env_path = [str(ROOT)] + ([str(tmp_path)] if tmp_path else [])
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(env_path)}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_loading_every_family_and_plugin_does_not_import_numba():
    out = _python("""
        import sys
        from grpolens import plugins
        plugins.load_plugins()
        import grpolens.functional.histogram, grpolens.analysis.recompute
        print('numba' in sys.modules)
    """)
    assert out == ["False"]


def test_a_kernel_calls_formulas_inlined_from_its_module_and_another_and_binds_as_a_method(tmp_path):
    # two modules: the formula in one, the kernel (calling it as a global and as a module
    # attribute) in the other; the first call compiles both with the formula in numba's hands
    (tmp_path / "formulas.py").write_text(textwrap.dedent("""
        from grpolens.functional.jit import inline

        @inline
        def twice(x):
            return 2.0 * x
    """))
    (tmp_path / "kernels.py").write_text(textwrap.dedent("""
        import numpy as np
        import formulas
        from formulas import twice
        from grpolens.functional.jit import kernel

        @kernel
        def total(x):
            acc = 0.0
            for v in x:
                acc += twice(v) + formulas.twice(v)
            return acc

        class Holder:
            total = total

        def scaled(k):  # a kernel made in a function, closing over a formula
            f = formulas.twice

            @kernel
            def scale(x):
                return k * f(x)
            return scale

        thrice_twice = scaled(3.0)
    """))
    out = _python("""
        import sys
        import numpy as np
        import kernels, formulas
        print('numba' in sys.modules, type(kernels.total).__name__)
        print(kernels.total(np.arange(4.0)), kernels.Holder().total is not None)
        print('numba' in sys.modules, type(kernels.total).__name__, type(formulas.twice).__name__)
        print(kernels.total.targetoptions['nogil'], formulas.twice(1.5), kernels.thrice_twice(1.0))
    """, tmp_path)
    assert out == ["False", "_Deferred", "24.0", "True", "True", "CPUDispatcher", "CPUDispatcher", "True", "3.0", "6.0"]


def test_the_first_kernel_call_does_not_import_scipy_linalg():
    # numba's numpy implementations import scipy.linalg (~0.15 s) only to pick BLAS for
    # np.correlate/np.convolve, which no kernel calls; a kernel's first call loads them without it
    out = _python("""
        import sys
        import numpy as np
        from grpolens.functional.histogram import edge_counts
        print(edge_counts(np.array([1.0, 6.0, 7.0]), np.array([0.0, 5.0, 20.0])).tolist())
        print('numba' in sys.modules, 'scipy.linalg' in sys.modules)
    """)
    assert out == ["[1,", "2]", "True", "False"]
