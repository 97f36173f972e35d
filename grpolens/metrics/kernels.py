"""The compiled per-sequence loops of the token families: each reads a batch's tokens once.

A family's numpy body makes a dozen full-length passes (masks, ``where``, differences, products,
one ``reduceat`` per column); each kernel here walks the sequences (``TokenBatch.starts`` /
``lengths``) and, per token, evaluates the family's formulas and keeps its per-sequence values.
The formulas themselves stay where they are written, once (:mod:`grpolens.functional.estimators`,
:mod:`grpolens.functional.policy_terms`); a kernel calls them compiled with
:func:`~grpolens.functional.jit.inline`, the numpy code of the families calls them on arrays.

Exactly numpy's numbers, bit for bit, so that a recompute's outputs do not change:

* **Sums** are added in numpy's order (:mod:`grpolens.functional.reduceat`: the first value,
  then numpy's pairwise sum of the rest). A kernel writes the sequence's per-token values into a
  small buffer (one row per column, the longest sequence long, in cache) and sums each row there.
  Counts are integers: any order.
* **Transcendentals** (``exp``, ``expm1``) come in as numpy arrays, not computed here: numpy's
  vectorised ``exp``/``expm1`` (AVX-512 machines) and the C library's that a kernel would call
  differ in the last bit of a few percent of values (measured: ``expm1`` 4.3 %, ``exp`` 4.7 % of
  14 M random values), and numpy's are faster (~2 ns vs ~6 ns a value). Those arrays are shared
  by other visitors anyway (``TokenBatch.ratio``, the kl family's per-token k3).
* **Extrema** fold with ``np.maximum``/``np.minimum`` (numpy's NaN propagation); only the sign
  of a zero extremum may differ from numpy's vectorised reduction, which no metric can see.

Imported lazily by the producers: numba's start-up is paid only by commands that reduce tokens.
"""

from __future__ import annotations

import numpy as np

from grpolens.functional import estimators as est
from grpolens.functional.jit import inline, kernel
from grpolens.functional.reduceat import segment_sum
from grpolens.functional import policy_terms as terms

_k3 = inline(est.k3_of)
_ppo, _cispo, _vespo = (inline(f) for f in (terms.ppo_term, terms.cispo_term, terms.vespo_term))
_k2 = inline(est.k2)
_low, _high, _over_cap = (inline(f) for f in (terms.clipped_low, terms.clipped_high, terms.clipped_cispo))


@inline
def _seq_sum(row, m):
    """``np.add.reduceat``'s value for a sequence whose m >= 1 values are ``row[:m]``."""
    return segment_sum(row, 0, m)


@inline
def _longest(lengths):
    return lengths.max() if len(lengths) else 0


@kernel
def finite_masked_sum(x, mask, starts, lengths):
    """Per sequence: Σ x and the count over masked tokens with a finite x."""
    ns = len(starts)
    sums, counts = np.empty(ns), np.empty(ns)
    buf = np.empty(_longest(lengths))
    for s in range(ns):
        lo, m, n = starts[s], lengths[s], 0
        for j in range(m):
            v = x[lo + j]
            ok = mask[lo + j] and np.isfinite(v)
            buf[j] = v if ok else 0.0
            n += ok
        sums[s], counts[s] = _seq_sum(buf, m), n
    return sums, counts


@kernel
def nonfinite_counts(mask, cols, starts, lengths):
    """Per sequence: row 0 the masked tokens, row 1 + k those whose ``cols[k]`` is not finite."""
    ns, k = len(starts), len(cols)
    out = np.zeros((k + 1, ns))
    for s in range(ns):
        lo = starts[s]
        for i in range(lo, lo + lengths[s]):
            if mask[i]:
                out[0, s] += 1.0
                for c in range(k):
                    if not np.isfinite(cols[c][i]):
                        out[c + 1, s] += 1.0
    return out


@kernel
def policy_sums(logp, old, mask, em1, starts, lengths):
    """The policy family's per-sequence values (see :func:`grpolens.metrics.policy._policy`).

    ``em1``: ``expm1(logp − old)`` per token (numpy's). Returns ``sums`` (rows: Σ logp over masked
    finite logp, Σ old, Σ d, Σ k3, Σ |e^d − 1| over ratio-valid tokens), ``counts`` (rows: masked
    finite logp, ratio-valid) and ``ext`` (rows: max k3, max d, min d; -inf / inf without a valid
    token)."""
    ns = len(starts)
    sums, counts, ext = np.empty((5, ns)), np.empty((2, ns)), np.empty((3, ns))
    buf = np.empty((5, _longest(lengths)))
    for s in range(ns):
        lo, m = starts[s], lengths[s]
        nnew = nv = 0
        k3max, dmax, dmin = -np.inf, -np.inf, np.inf
        for j in range(m):
            i = lo + j
            lp, od = logp[i], old[i]
            vnew = mask[i] and np.isfinite(lp)
            v = vnew and np.isfinite(od)
            d = lp - od if v else 0.0
            e = em1[i] if v else 0.0
            k3 = _k3(d, e)
            buf[0, j] = lp if vnew else 0.0
            buf[1, j] = od if v else 0.0
            buf[2, j] = d
            buf[3, j] = k3
            buf[4, j] = abs(e)
            nnew += vnew
            nv += v
            k3max = np.maximum(k3max, k3)
            if v:
                dmax, dmin = np.maximum(dmax, d), np.minimum(dmin, d)
        for q in range(5):
            sums[q, s] = _seq_sum(buf[q], m)
        counts[0, s], counts[1, s] = nnew, nv
        ext[0, s], ext[1, s], ext[2, s] = (k3max if nv else -np.inf), dmax, dmin
    return sums, counts, ext


@kernel
def ratio_abs_max(logp, old, mask):
    """max |logp − old| over the ratio-valid tokens (0 without one): whether a clamp bites."""
    out = 0.0
    for i in range(len(logp)):
        if mask[i] and np.isfinite(logp[i]) and np.isfinite(old[i]):
            out = max(out, abs(logp[i] - old[i]))
    return out


@inline
def _nan_to_num(x):
    """``np.nan_to_num`` of one value: NaN 0, ±inf the largest finite float of its sign."""
    if np.isnan(x):
        return 0.0
    if np.isinf(x):
        return 1.7976931348623157e308 if x > 0 else -1.7976931348623157e308
    return x


#: The policy term of :func:`loss_sums` (``kind``): the loss families' formulas, in their module.
PPO, CISPO, VESPO, GIVEN = 0, 1, 2, 3


@kernel
def loss_sums(logp, old, adv, mask, c, c_masked, kind, lo, hi, delta, cap, given, phi,
              w, keep, ref, k3, beta, bias, ent, ec, starts, lengths):
    """Per sequence Σ L and the count of its valid tokens, L the loss of
    :func:`grpolens.metrics.loss.loss_partials` (which documents each argument); arrays a
    ``kind`` or flag does not use may be empty."""
    ns = len(starts)
    sums, counts = np.empty(ns), np.empty(ns)
    buf = np.empty(_longest(lengths))
    has_is, with_kl = len(w) > 0, len(k3) > 0
    for s in range(ns):
        first, m, nv = starts[s], lengths[s], 0
        for j in range(m):
            i = first + j
            lp = logp[i]
            rv = mask[i] and np.isfinite(lp) and np.isfinite(old[i])
            av = rv and np.isfinite(adv[i])
            v = av and (not with_kl or np.isfinite(ref[i]))
            a = adv[i] if av else 0.0
            ci = (c[i] if rv else 1.0) if c_masked else c[i]
            if kind == PPO:
                L = _ppo(ci, a, lo, hi, delta)
            elif kind == CISPO:
                L = _cispo(ci, a, cap, lp if v else 0.0)
            elif kind == VESPO:
                L = _vespo(phi[s], a, lp if v else 0.0)
            else:
                L = given[i]
            if has_is:
                v = v and keep[i]
                L = L * w[i] if v else 0.0
            if with_kl:
                L = L + beta * (k3[i] * ci if bias else k3[i])
                L = L if v else 0.0
            if ec != 0.0:
                L = L - ec * (_nan_to_num(ent[i]) if v else 0.0)
            buf[j] = L
            nv += v
        sums[s], counts[s] = _seq_sum(buf, m), nv
    return sums, counts


@kernel
def masked_ratio(r, logp, old, mask):
    """``r`` on the ratio-valid tokens, 1 elsewhere (``np.where(ratio_valid, r, 1.0)``)."""
    out = np.empty(len(r))
    for i in range(len(r)):
        out[i] = r[i] if mask[i] and np.isfinite(logp[i]) and np.isfinite(old[i]) else 1.0
    return out


@kernel
def kl_inputs(logp, ref, mask):
    """(valid, x): masked tokens with finite logp and ref_logp, and x = ref − logp there, 0 elsewhere."""
    n = len(logp)
    valid, x = np.empty(n, np.bool_), np.empty(n)
    for i in range(n):
        v = mask[i] and np.isfinite(logp[i]) and np.isfinite(ref[i])
        valid[i] = v
        x[i] = ref[i] - logp[i] if v else 0.0
    return valid, x


@kernel
def kl_sums(valid, x, k3, mask, logp, old, c, c_masked, starts, lengths):
    """The kl family's per-sequence values (see :func:`grpolens.metrics.kl._kl`): ``sums`` (rows:
    Σ x, Σ k2(x), Σ k3, Σ k3·c), ``counts`` (rows: valid, masked, valid with a ratio when
    ``c_masked``), the largest k3 (-inf without a valid token) and the largest |x|."""
    ns = len(starts)
    sums, counts, k3max = np.empty((4, ns)), np.empty((3, ns)), np.empty(ns)
    buf = np.empty((4, _longest(lengths)))
    xmax = 0.0
    for s in range(ns):
        first, m = starts[s], lengths[s]
        n = nm = nc = 0
        top = -np.inf
        for j in range(m):
            i = first + j
            xi, ki, v = x[i], k3[i], valid[i]
            buf[0, j] = xi
            buf[1, j] = _k2(xi)
            buf[2, j] = ki
            if c_masked:  # token level: × the ratio where it is defined, 0 elsewhere
                rv = mask[i] and np.isfinite(logp[i]) and np.isfinite(old[i])
                buf[3, j] = ki * c[i] if rv else 0.0
                nc += v and rv
            else:
                buf[3, j] = ki * c[i]
            n += v
            nm += mask[i]
            top = np.maximum(top, ki)
            xmax = max(xmax, abs(xi))
        for q in range(4):
            sums[q, s] = _seq_sum(buf[q], m)
        counts[0, s], counts[1, s], counts[2, s] = n, nm, (nc if c_masked else n)
        k3max[s] = top if n else -np.inf
    return sums, counts, k3max, xmax


@kernel
def clip_counts(logp, old, adv, mask, r, c, c_masked, lo, hi, delta, cap, ppo, cispo, sums_too, starts, lengths):
    """The clip family's per-sequence counts (see :func:`grpolens.metrics.clip._clip`); r: the
    token ratio (1 is taken off the ratio-valid tokens), c the loss' weight per token (the same
    when ``c_masked``). Rows of ``counts``: ratio-valid, r < lo, r > hi (the unconditional
    rates), advantage-valid, and with ``ppo`` / ``cispo`` the clip family's indicators on (c, A)
    (A = 0 off the valid tokens): low, high, cispo.
    ``sums_too``: also Σ A and Σ d over the valid tokens (rows of ``sums``), for the
    sequence-level weights."""
    ns = len(starts)
    counts, sums = np.zeros((7, ns)), np.zeros((2, ns))
    buf = np.empty((2, _longest(lengths) if sums_too else 0))
    for s in range(ns):
        first, m = starts[s], lengths[s]
        for j in range(m):
            i = first + j
            rv = mask[i] and np.isfinite(logp[i]) and np.isfinite(old[i])
            av = rv and np.isfinite(adv[i])
            ri = r[i] if rv else 1.0
            a = adv[i] if av else 0.0
            counts[0, s] += rv
            counts[1, s] += ri < lo
            counts[2, s] += ri > hi
            counts[3, s] += av
            ci = ri if c_masked else c[i]
            if ppo:
                counts[4, s] += _low(ci, a, lo, delta)
                counts[5, s] += _high(ci, a, hi, delta)
            if cispo:
                counts[6, s] += _over_cap(ci, a, cap)
            if sums_too:
                buf[0, j] = a
                buf[1, j] = logp[i] - old[i] if rv else 0.0
        if sums_too:
            sums[0, s], sums[1, s] = _seq_sum(buf[0], m), _seq_sum(buf[1], m)
    return counts, sums
