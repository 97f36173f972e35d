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

How they are written, for speed (measured on 10 M tokens): each sequence's columns are sliced
once and indexed from 0 (no negative-index test per access), masks are combined with ``&``, not
``and`` (no branch per token), and counts run in local integers: a float ``+=`` is a chain of dependent
additions (float addition does not reassociate, so it cannot be vectorised), an integer one is
not (4 counts of a shard in cache: 2.2 -> 0.45 ns a token; a masked sum 2.4 -> 0.7-0.9 ns).

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


@inline
def _max_of(row, m):
    """The largest of ``row[:m]`` with numpy's NaN propagation (-inf when m = 0), in 4 running
    maxima: a running maximum inside a token loop is a chain of dependent steps that keeps the
    loop from being vectorised, so kernels write values to a row and take the maximum after."""
    a0 = a1 = a2 = a3 = -np.inf
    k = 0
    while k + 4 <= m:
        a0, a1 = np.maximum(a0, row[k]), np.maximum(a1, row[k + 1])
        a2, a3 = np.maximum(a2, row[k + 2]), np.maximum(a3, row[k + 3])
        k += 4
    while k < m:
        a0 = np.maximum(a0, row[k])
        k += 1
    return np.maximum(np.maximum(a0, a1), np.maximum(a2, a3))


@inline
def _min_of(row, m):
    """The smallest of ``row[:m]`` (numpy's NaN propagation; inf when m = 0), as :func:`_max_of`."""
    a0 = a1 = a2 = a3 = np.inf
    k = 0
    while k + 4 <= m:
        a0, a1 = np.minimum(a0, row[k]), np.minimum(a1, row[k + 1])
        a2, a3 = np.minimum(a2, row[k + 2]), np.minimum(a3, row[k + 3])
        k += 4
    while k < m:
        a0 = np.minimum(a0, row[k])
        k += 1
    return np.minimum(np.minimum(a0, a1), np.minimum(a2, a3))


@inline
def _ratio_valid(mask, logp, old):
    """A masked token whose current and old log-probs are finite (its ratio is defined)."""
    return mask & np.isfinite(logp) & np.isfinite(old)


@kernel
def finite_masked_sum(x, mask, starts, lengths):
    """Per sequence: Σ x and the count over masked tokens with a finite x."""
    ns = len(starts)
    sums, counts = np.empty(ns), np.empty(ns)
    buf = np.empty(_longest(lengths))
    for s in range(ns):
        lo, m = starts[s], lengths[s]
        xs, ms = x[lo:lo + m], mask[lo:lo + m]
        n = 0
        for j in range(m):
            v = xs[j]
            ok = ms[j] & np.isfinite(v)
            buf[j] = v if ok else 0.0
            n += np.int64(ok)
        sums[s], counts[s] = _seq_sum(buf, m), n
    return sums, counts


@kernel
def nonfinite_counts(mask, cols, starts, lengths):
    """Per sequence: row 0 the masked tokens, row 1 + k those whose ``cols[k]`` is not finite."""
    ns, k = len(starts), len(cols)
    out = np.empty((k + 1, ns))
    for s in range(ns):
        lo, m = starts[s], lengths[s]
        ms = mask[lo:lo + m]
        n = 0
        for j in range(m):
            n += np.int64(ms[j])
        out[0, s] = n
        for c in range(k):
            xs = cols[c][lo:lo + m]
            n = 0
            for j in range(m):
                n += np.int64(ms[j] & ~np.isfinite(xs[j]))
            out[c + 1, s] = n
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
    buf = np.empty((7, _longest(lengths)))
    b0, b1, b2, b3, b4, b5, b6 = buf[0], buf[1], buf[2], buf[3], buf[4], buf[5], buf[6]
    for s in range(ns):
        lo, m = starts[s], lengths[s]
        lps, ods, ms, ems = logp[lo:lo + m], old[lo:lo + m], mask[lo:lo + m], em1[lo:lo + m]
        # three loops over the sequence (in cache), each with few arrays: with a dozen, the
        # compiler's checks that no two overlap are too many and it does not vectorise at all
        nnew = nv = 0
        for j in range(m):
            lp, od = lps[j], ods[j]
            vnew = ms[j] & np.isfinite(lp)
            v = vnew & np.isfinite(od)
            b0[j] = lp if vnew else 0.0
            b1[j] = od if v else 0.0
            nnew += np.int64(vnew)
            nv += np.int64(v)
        for j in range(m):
            lp, od = lps[j], ods[j]
            v = _ratio_valid(ms[j], lp, od)
            d = lp - od if v else 0.0
            e = ems[j] if v else 0.0
            b2[j] = d
            b3[j] = _k3(d, e)
            b4[j] = abs(e)
        for j in range(m):
            lp, od = lps[j], ods[j]
            v = _ratio_valid(ms[j], lp, od)
            b5[j] = lp - od if v else -np.inf
            b6[j] = lp - od if v else np.inf
        sums[0, s], sums[1, s], sums[2, s] = _seq_sum(b0, m), _seq_sum(b1, m), _seq_sum(b2, m)
        sums[3, s], sums[4, s] = _seq_sum(b3, m), _seq_sum(b4, m)
        counts[0, s], counts[1, s] = nnew, nv
        ext[0, s] = _max_of(b3, m) if nv else -np.inf
        ext[1, s], ext[2, s] = _max_of(b5, m), _min_of(b6, m)
    return sums, counts, ext


@kernel
def ratio_abs_max(logp, old, mask):
    """max |logp − old| over the ratio-valid tokens (0 without one): whether a clamp bites."""
    out = 0.0
    for i in range(len(logp)):
        d = abs(logp[i] - old[i])
        out = max(out, d if _ratio_valid(mask[i], logp[i], old[i]) else 0.0)
    return out


@inline
def _nan_to_num(x):
    """``np.nan_to_num`` of one value: NaN 0, ±inf the largest finite float of its sign."""
    big = 1.7976931348623157e308
    return 0.0 if np.isnan(x) else (big if x == np.inf else (-big if x == -np.inf else x))


#: The policy term of :func:`loss_sums` (``kind``): the loss families' formulas, in their module.
PPO, CISPO, VESPO, GIVEN = 0, 1, 2, 3


@kernel
def loss_sums(logp, old, adv, mask, c, c_masked, kind, lo, hi, delta, cap, given, phi,
              has_is, w, keep, with_kl, ref, k3, beta, bias, ent, ec, starts, lengths):
    """Per sequence Σ L and the count of its valid tokens, L the loss of
    :func:`grpolens.metrics.loss.loss_partials` (which documents each argument). Every array is
    full length (a neutral one where its flag is off), and each token computes every term and
    keeps the one its ``kind`` and flags name: with no branch and no load under a flag, the
    loop vectorises."""
    ns = len(starts)
    sums, counts = np.empty(ns), np.empty(ns)
    buf = np.empty(_longest(lengths))
    for s in range(ns):
        f, m = starts[s], lengths[s]
        e = f + m
        lps, ods, ads, ms, cs = logp[f:e], old[f:e], adv[f:e], mask[f:e], c[f:e]
        gs, ws, ks, rs, k3s, hs = given[f:e], w[f:e], keep[f:e], ref[f:e], k3[f:e], ent[f:e]
        ph = phi[s]
        nv = 0
        for j in range(m):
            lp = lps[j]
            rv = _ratio_valid(ms[j], lp, ods[j])
            av = rv & np.isfinite(ads[j])
            v = av & (np.isfinite(rs[j]) | (not with_kl))
            a = ads[j] if av else 0.0
            ci = (cs[j] if rv else 1.0) if c_masked else cs[j]
            lpv = lp if v else 0.0
            L = (_ppo(ci, a, lo, hi, delta) if kind == PPO else _cispo(ci, a, cap, lpv) if kind == CISPO
                 else _vespo(ph, a, lpv) if kind == VESPO else gs[j])
            v = v & ks[j]  # keep: all True without a rollout correction
            L = (L * ws[j] if v else 0.0) if has_is else L
            lk = L + beta * (k3s[j] * ci if bias else k3s[j])
            L = (lk if v else 0.0) if with_kl else L
            L = L - ec * (_nan_to_num(hs[j]) if v else 0.0) if ec != 0.0 else L
            buf[j] = L
            nv += np.int64(v)
        sums[s], counts[s] = _seq_sum(buf, m), nv
    return sums, counts


@kernel
def masked_ratio(r, logp, old, mask):
    """``r`` on the ratio-valid tokens, 1 elsewhere (``np.where(ratio_valid, r, 1.0)``)."""
    out = np.empty(len(r))
    for i in range(len(r)):
        out[i] = r[i] if _ratio_valid(mask[i], logp[i], old[i]) else 1.0
    return out


@kernel
def kl_inputs(logp, ref, mask):
    """(valid, x): masked tokens with finite logp and ref_logp, and x = ref − logp there, 0 elsewhere."""
    n = len(logp)
    valid, x = np.empty(n, np.bool_), np.empty(n)
    for i in range(n):
        v = mask[i] & np.isfinite(logp[i]) & np.isfinite(ref[i])
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
    buf = np.empty((5, _longest(lengths)))
    b0, b1, b2, b3, b4 = buf[0], buf[1], buf[2], buf[3], buf[4]
    xmax = 0.0
    for s in range(ns):
        f, m = starts[s], lengths[s]
        e = f + m
        vs, xs, k3s, ms, lps, ods, cs = valid[f:e], x[f:e], k3[f:e], mask[f:e], logp[f:e], old[f:e], c[f:e]
        n = nm = nc = 0
        for j in range(m):
            xi, ki, v = xs[j], k3s[j], vs[j]
            # token level (c_masked): × the ratio where it is defined, 0 elsewhere
            rv = _ratio_valid(ms[j], lps[j], ods[j])
            b0[j] = xi
            b1[j] = _k2(xi)
            b2[j] = ki
            b3[j] = ki * cs[j] if rv | (not c_masked) else 0.0
            b4[j] = abs(xi)
            nc += np.int64(v & rv)
            n += np.int64(v)
            nm += np.int64(ms[j])
        sums[0, s], sums[1, s], sums[2, s], sums[3, s] = _seq_sum(b0, m), _seq_sum(b1, m), _seq_sum(b2, m), _seq_sum(b3, m)
        counts[0, s], counts[1, s], counts[2, s] = n, nm, (nc if c_masked else n)
        k3max[s] = _max_of(b2, m) if n else -np.inf
        xmax = max(xmax, _max_of(b4, m))
    return sums, counts, k3max, xmax


@kernel
def clip_counts(logp, old, adv, mask, r, c, c_masked, lo, hi, delta, cap, ppo, cispo, sums_too, starts, lengths):
    """The clip family's per-sequence counts (see :func:`grpolens.metrics.clip._clip`); r: the
    token ratio (1 is taken off the ratio-valid tokens), c the loss' weight per token (the same
    when ``c_masked``). Rows of ``counts``: ratio-valid, r < lo, r > hi (the unconditional
    rates), advantage-valid, and with ``ppo`` / ``cispo`` the clip family's indicators on (c, A)
    (A = 0 off the valid tokens): low, high, cispo. ``sums_too``: also Σ A and Σ d over the
    valid tokens (rows of ``sums``), for the sequence-level weights."""
    ns = len(starts)
    counts, sums = np.zeros((7, ns)), np.zeros((2, ns))
    buf = np.empty((2, _longest(lengths)))  # written always: a store under a flag stops vectorising
    b0, b1 = buf[0], buf[1]
    for s in range(ns):
        f, m = starts[s], lengths[s]
        e = f + m
        lps, ods, ads, ms, rs, cs = logp[f:e], old[f:e], adv[f:e], mask[f:e], r[f:e], c[f:e]
        nrv = nlo = nhi = nav = nlow = nhigh = ncap = 0
        for j in range(m):
            rv = _ratio_valid(ms[j], lps[j], ods[j])
            av = rv & np.isfinite(ads[j])
            ri = rs[j] if rv else 1.0
            a = ads[j] if av else 0.0
            nrv += np.int64(rv)
            nlo += np.int64(ri < lo)
            nhi += np.int64(ri > hi)
            nav += np.int64(av)
            ci = ri if c_masked else cs[j]
            if ppo:
                nlow += np.int64(_low(ci, a, lo, delta))
                nhigh += np.int64(_high(ci, a, hi, delta))
            if cispo:
                ncap += np.int64(_over_cap(ci, a, cap))
            b0[j] = a
            b1[j] = lps[j] - ods[j] if rv else 0.0
        counts[0, s], counts[1, s], counts[2, s], counts[3, s] = nrv, nlo, nhi, nav
        counts[4, s], counts[5, s], counts[6, s] = nlow, nhigh, ncap
        if sums_too:
            sums[0, s], sums[1, s] = _seq_sum(b0, m), _seq_sum(b1, m)
    return counts, sums
