"""grpolens.functional.estimators: the KL estimators k1/k2/k3 and the ±20 log-ratio bound against
an independent reference (50-digit decimal arithmetic), hand-worked values, edge cases (0, tiny,
huge, ±inf, NaN), their defining property (k1 and k3 are unbiased estimates of KL(q‖p) under q),
and a scan of grpolens/ showing each is written there once."""

import ast
import math
from decimal import Decimal, localcontext
from pathlib import Path

import numpy as np
import pytest

from grpolens.functional import estimators as est

ROOT = Path(__file__).resolve().parents[2] / "grpolens"
HOME = ROOT / "functional" / "estimators.py"


def _ref_k3(x: float) -> float:
    """e^x − 1 − x in 50 significant digits, rounded once to float64."""
    with localcontext() as ctx:
        ctx.prec = 50
        d = Decimal(x)
        return float(d.exp() - 1 - d)


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------

def test_hand_worked_values():
    ln2 = math.log(2.0)
    # p/q = 2: k3 = 2 − 1 − ln 2; p/q = 1/2: k3 = 1/2 − 1 + ln 2
    assert est.k3(np.array([ln2]))[0] == pytest.approx(1.0 - ln2, rel=1e-15)
    assert est.k3(np.array([-ln2]))[0] == pytest.approx(ln2 - 0.5, rel=1e-15)
    assert est.k2(np.array([0.3]))[0] == pytest.approx(0.045, rel=1e-15)
    assert est.k1(np.array([0.3]))[0] == -0.3
    assert est.k3(np.array([0.0]))[0] == 0.0 and est.k2(np.array([0.0]))[0] == 0.0
    assert est.bounded_exp(np.array([math.log(3.0)]))[0] == pytest.approx(3.0, rel=1e-15)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k3_against_a_50_digit_reference_over_every_scale(seed):
    rng = np.random.default_rng(seed)
    mags = 10.0 ** rng.uniform(-12, np.log10(700.0), 500)
    x = mags * rng.choice([-1.0, 1.0], 500)
    got = est.k3(x)
    want = np.array([_ref_k3(float(v)) for v in x])
    # expm1 keeps full precision where the naive e^x − 1 − x loses all of it (|x| ~ 1e-9: k3 ~ 5e-19,
    # below float64's resolution of 1 + x); what is left is the rounding of expm1(x) and of the
    # subtraction: a few ulps of x (k3 ≈ x²/2 is far smaller than x there) or of the value
    err = np.abs(got - want)
    assert np.all(err <= 4 * np.spacing(np.abs(x)) + 1e-14 * want), x[np.argmax(err / want)]
    big = np.abs(x) > 1e-3
    np.testing.assert_allclose(got[big], want[big], rtol=1e-12)


def test_k3_of_a_tiny_log_ratio_is_x_squared_over_two():
    x = np.array([1e-10, -1e-10, 3e-8])
    # k3 = x²/2 + x³/6 + ...; within a few ulps of x (1e-26 here, 1e-6 of k3 = 5e-21)
    np.testing.assert_allclose(est.k3(x), x * x / 2 + x ** 3 / 6, rtol=1e-5)
    assert np.all(est.k3(x) > 0)


def test_k3_reuses_a_given_expm1():
    rng = np.random.default_rng(3)
    x = rng.normal(size=100)
    assert np.array_equal(est.k3(x, em1=np.expm1(x)), est.k3(x))


def test_k1_k2_are_their_closed_forms_on_random_data():
    rng = np.random.default_rng(4)
    x = rng.normal(scale=3.0, size=1000)
    assert np.array_equal(est.k1(x), -x)
    np.testing.assert_allclose(est.k2(x), x ** 2 / 2, rtol=1e-15)
    assert np.all(est.k2(x) >= 0) and np.all(est.k3(x) >= 0)


def test_edge_cases_nan_and_inf(recwarn):
    x = np.array([np.nan, np.inf, -np.inf, 710.0, -710.0])
    k3 = est.k3(x)
    assert np.isnan(k3[0])
    # inf − inf: NaN (callers keep only finite log-ratios); e^−inf − 1 + inf = inf
    assert np.isnan(k3[1]) and k3[2] == np.inf
    assert k3[3] == np.inf  # overflows, without a warning
    assert k3[4] == pytest.approx(709.0)
    assert not [w for w in recwarn.list if issubclass(w.category, RuntimeWarning)]
    b = est.bounded_exp(x)
    assert np.isnan(b[0])
    np.testing.assert_allclose(b[1:], np.exp([20.0, -20.0, 20.0, -20.0]), rtol=1e-15)
    assert np.isnan(est.k1(x[:1])[0]) and np.isnan(est.k2(x[:1])[0])
    assert est.k2(x[1:3]).tolist() == [np.inf, np.inf]
    assert est.k3(np.zeros(0)).shape == (0,)


def test_the_bound():
    assert est.LOG_RATIO_BOUND == 20.0
    x = np.array([-25.0, -20.0, -3.0, 0.0, 19.5, 20.0, 1e300, np.nan])
    c = est.clip_log_ratio(x)
    assert c[:-1].tolist() == [-20.0, -20.0, -3.0, 0.0, 19.5, 20.0, 20.0] and np.isnan(c[-1])
    assert est.clip_log_ratio(np.array([-70.0, 70.0]), 60.0).tolist() == [-60.0, 60.0]
    np.testing.assert_allclose(est.bounded_exp2(x[:-1]), est.bounded_exp(x[:-1]) ** 2, rtol=1e-14)


@pytest.mark.parametrize("seed", [5, 6])
def test_k1_and_k3_are_unbiased_for_kl_under_q(seed):
    """Σ_t q(t)·k(log p(t)/q(t)) = KL(q‖p) exactly for k1 and k3 (over the whole support, no sampling)."""
    rng = np.random.default_rng(seed)
    q, p = rng.dirichlet(np.ones(50)), rng.dirichlet(np.ones(50))
    x = np.log(p) - np.log(q)
    kl = float(np.sum(q * (np.log(q) - np.log(p))))
    assert float(np.sum(q * est.k1(x))) == pytest.approx(kl, rel=1e-12)
    assert float(np.sum(q * est.k3(x))) == pytest.approx(kl, rel=1e-12)
    assert float(np.sum(q * est.k2(x))) >= 0


def test_formula_texts():
    assert est.formula("k3", "ref - logp") == "exp(ref - logp) - (ref - logp) - 1"
    assert est.formula("ratio", "logp - old_logp") == "exp(logp - old_logp)"
    assert est.formula("bounded_ratio") == "exp(clip(x, ±20))"
    assert set(est.FORMULAS) == {"k1", "k2", "k3", "ratio", "bounded_ratio"}


def test_the_dashboard_shows_these_formulas():
    from grpolens.serve.data.tokens import SCORES

    assert est.formula("k3", "ref - logp") in SCORES["kl"]
    assert est.formula("ratio", "logp - old_logp") in SCORES["ratio"]


# ---------------------------------------------------------------------------------------------
# Written once: a scan of grpolens/
# ---------------------------------------------------------------------------------------------

def _callee(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        f = node.func
        return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return None


def _is_20(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value == 20


def k3_and_bound_sites(tree: ast.AST) -> list[tuple[int, str]]:
    """Where a module writes k3 (``expm1(x) − x``, ``r − x`` with ``r = expm1(x)``, ``exp(x) − 1 − x``)
    or the ±20 bound (20 as a clip/min/max argument, or the float 20.0 anywhere)."""
    out = []
    em1_of: dict[str, str] = {}  # names assigned expm1(arg) -> dump of arg
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _callee(node.value) == "expm1" and node.value.args:
            for t in node.targets:
                if isinstance(t, ast.Name):
                    em1_of[t.id] = ast.dump(node.value.args[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub):
            left, right = node.left, ast.dump(node.right)
            if _callee(left) == "expm1" and left.args and ast.dump(left.args[0]) == right:
                out.append((node.lineno, "k3: expm1(x) - x"))
            elif isinstance(left, ast.Name) and em1_of.get(left.id) == right:
                out.append((node.lineno, "k3: r - x with r = expm1(x)"))
            elif (isinstance(left, ast.BinOp) and isinstance(left.op, ast.Sub) and _callee(left.left) == "exp"
                  and left.left.args and ast.dump(left.left.args[0]) == right):
                out.append((node.lineno, "k3: exp(x) - 1 - x"))
        if _callee(node) in ("clip", "minimum", "maximum", "min", "max") and any(_is_20(a) for a in node.args):
            out.append((node.lineno, "the ±20 bound as a literal"))
        if isinstance(node, ast.Constant) and type(node.value) is float and node.value == 20.0:
            out.append((node.lineno, "20.0"))
    return out


def test_the_scan_finds_each_way_of_writing_them():
    src = ("import numpy as np\nB = 20.0\na = np.expm1(x) - x\nr = np.expm1(d)\nk = r - d\nc = np.exp(y) - 1 - y\n"
           "z = np.clip(d, -20, 20)\nm = min(v, 20.0)\nok = np.expm1(x) - y\n")
    kinds = [k for _, k in k3_and_bound_sites(ast.parse(src))]
    assert sorted(kinds) == sorted(["20.0", "20.0", "k3: expm1(x) - x", "k3: r - x with r = expm1(x)",
                                    "k3: exp(x) - 1 - x", "the ±20 bound as a literal", "the ±20 bound as a literal"])


def test_k3_and_the_bound_are_written_once_in_grpolens():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        sites = k3_and_bound_sites(ast.parse(path.read_text()))
        if sites:
            found[str(path.relative_to(ROOT.parent))] = sites
    home = str(HOME.relative_to(ROOT.parent))
    assert sorted(k for _, k in found.pop(home, [])) == ["20.0", "k3: r - x with r = expm1(x)"]
    assert not found, f"k3 or the ±20 bound written outside {home}: {found}"
