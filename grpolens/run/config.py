"""Checking and normalising the algorithm config that metrics depend on: the one schema.

The config comes from the run's manifest, then ``--config FILE``, then ``--set key=value``. Every
bad value is reported with the key that holds it, e.g. ``config key 'epsilon': must be a number
>= 0, got 'abc'``. ``grpolens validate`` checks the manifest's config with :func:`check_config`
and every command the resolved one, so the two never disagree. A key nobody reads is refused
where it is given (:func:`check_keys`): a typo in ``--set`` would otherwise be a what-if equal to
the run.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Iterable

from grpolens.errors import UserError
from grpolens.functional.rollout_is.config import MODES as IS_MODES, RS_OPTIONS
from grpolens.functional.estimators import LOG_RATIO_BOUND

_SMALLEST_WEIGHT = math.exp(-LOG_RATIO_BOUND)

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "gspo", "cispo", "sapo", "luspo", "vespo")
IS_LEVELS = ("token", "sequence", "sequence_token")
SCALE_REWARDS = ("group", "batch", "none")


def _bad(key: str, why: str, value: Any) -> UserError:
    return UserError(f"config key {key!r}: {why}, got {value!r}")


#: The largest count a config key may hold: the format's positions and lengths are int32.
MAX_COUNT = 2**31 - 1


def _number(cfg: dict, key: str, *, minimum: float | None = None, strict: bool = False, allow_none: bool = False,
            maximum: float | None = None) -> None:
    v = cfg.get(key)
    if v is None:
        if allow_none:
            return
        raise _bad(key, "must be set", v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise _bad(key, "must be a number", cfg.get(key)) from None
    v = float(v)
    if v != v:
        raise _bad(key, "must not be NaN", v)
    if math.isinf(v):
        raise _bad(key, "must be finite", cfg.get(key))
    if minimum is not None and (v <= minimum if strict else v < minimum):
        raise _bad(key, f"must be {'>' if strict else '>='} {minimum}", cfg.get(key))
    if maximum is not None and v > maximum:
        raise _bad(key, f"must be <= {maximum}", cfg.get(key))
    cfg[key] = v


def _int(cfg: dict, key: str, *, minimum: int = 1, allow_none: bool = True) -> None:
    v = cfg.get(key)
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or int(v) != v \
            or not minimum <= v <= MAX_COUNT:
        raise _bad(key, f"must be an integer from {minimum} to {MAX_COUNT:,}", v)
    cfg[key] = int(v)


def check_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Validate and normalise a resolved config (returns a new dict).

    Normalisations: ``epsilon_high`` None -> ``epsilon``; ``loss_type`` lower-cased;
    ``scale_rewards`` True/False -> "group"/"none"; ``rollout_is`` thresholds to ``{lower, upper}``.
    """
    cfg = dict(cfg)
    lt = cfg.get("loss_type")
    if not isinstance(lt, str) or lt.lower() not in LOSS_TYPES:
        raise _bad("loss_type", f"must be one of {', '.join(LOSS_TYPES)}", lt)
    cfg["loss_type"] = lt.lower()
    _number(cfg, "epsilon", minimum=0.0, maximum=1.0)  # the ratio's lower clip 1 - epsilon stays >= 0
    if cfg.get("epsilon_high") is None:
        cfg["epsilon_high"] = cfg["epsilon"]
    _number(cfg, "epsilon_high", minimum=0.0)
    _number(cfg, "delta", minimum=0.0, strict=True, allow_none=True)
    _number(cfg, "beta", minimum=0.0)
    _number(cfg, "temperature", minimum=0.0, strict=True)
    _number(cfg, "sapo_temperature_pos", minimum=0.0, strict=True)
    _number(cfg, "sapo_temperature_neg", minimum=0.0, strict=True)
    for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        _number(cfg, k, minimum=0.0)
    _number(cfg, "entropy_coef", minimum=0.0, allow_none=True)
    _number(cfg, "log_ratio_clamp", minimum=0.0, strict=True, allow_none=True)
    lvl = cfg.get("importance_sampling_level")
    if lvl not in IS_LEVELS:
        raise _bad("importance_sampling_level", f"must be one of {', '.join(IS_LEVELS)}", lvl)
    for k in ("max_completion_length", "num_generations", "gradient_accumulation_steps", "steps_per_generation", "num_iterations"):
        _int(cfg, k)
    sr = cfg.get("scale_rewards")
    if sr is True:
        sr = "group"
    elif sr is False:
        sr = "none"
    if sr not in SCALE_REWARDS:
        raise _bad("scale_rewards", f"must be one of {', '.join(SCALE_REWARDS)} (or true/false)", cfg.get("scale_rewards"))
    cfg["scale_rewards"] = sr
    if not isinstance(cfg.get("use_bias_correction_kl"), bool):
        raise _bad("use_bias_correction_kl", "must be true or false", cfg.get("use_bias_correction_kl"))
    if not isinstance(cfg.get("rollout_metrics", True), bool):
        raise _bad("rollout_metrics", "must be true or false", cfg.get("rollout_metrics"))
    rw = cfg.get("reward_weights")
    if rw is not None and not (isinstance(rw, (list, dict))):
        raise _bad("reward_weights", "must be a list of numbers or an object name -> weight", rw)
    given_is = cfg.get("rollout_is")
    cfg["rollout_is"] = normalize_rollout_is(given_is)
    if cfg["loss_type"] == "vespo" and cfg["rollout_is"] is not None:
        _check_vespo_is(cfg["rollout_is"], given_is)
    return cfg


def _check_vespo_is(ris: dict[str, Any], given: Any) -> None:
    """VESPO folds TRL's token IS weights into its sequence weight φ (TRL's ``get_gamma_weights``):
    reproduced for TRL's ``token_truncate`` and ``token_mask`` (what TRL 1.16 accepts with VESPO)
    with a band around 1. Off the completion mask TRL's ratio is 1 and its log enters φ over every
    padded position, which a run does not hold unless the mode leaves 1 unchanged."""
    why = None
    if ris["level"] != "token" or ris["mode"] not in ("truncate", "truncate_upper", "icepop"):
        why = (f"loss_type vespo is reproduced only with TRL's vLLM IS modes token_truncate and token_mask (TRL "
               f"refuses the others with VESPO), not level {ris['level']!r} mode {ris['mode']!r}")
    elif ris["veto_lower"] is not None or ris["veto_upper"] is not None or ris["rs"] or ris.get("batch_normalize"):
        why = "loss_type vespo is reproduced only with TRL's vLLM IS correction (no veto, rejection filter or batch normalisation)"
    elif (ris["lower"] is not None and ris["lower"] > 1.0) or ris["upper"] < 1.0:
        why = ("loss_type vespo with an IS band that excludes 1 is not reproduced (TRL adds the log weight of every "
               "padded position into φ, and a run holds no padding)")
    if why:
        raise _bad("rollout_is", why, given)


#: Config keys read outside :data:`~grpolens.run.format.CONFIG_DEFAULTS`: files and models the run
#: names, and trainer settings that integrations record and profiles read.
EXTRA_KEYS = ("vocab_file", "tokenizer", "top_k_tokens", "reward_funcs", "trl_args", "mask_truncated_completions",
              "verl_actor", "verl_algorithm", "verl_rollout")


def known_keys(manifest_config: Iterable[str] = ()) -> set[str]:
    """The config keys a ``--set`` or ``--config`` may give: those grpolens reads, and those the
    run's own manifest holds (a trainer's settings, kept as it wrote them)."""
    from grpolens.run.format import CONFIG_DEFAULTS

    return {*CONFIG_DEFAULTS, *EXTRA_KEYS, *manifest_config}


def closest(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known name closest to ``name`` (difflib), or nothing."""
    hit = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {hit[0]!r}?)" if hit else ""


def check_keys(given: dict[str, Any], known: Iterable[str], source: str) -> None:
    """Refuse the first key of ``given`` not in ``known``, naming it, ``source`` (``--set``,
    ``--config FILE``) and the closest known key."""
    known = set(known)
    for key in given:
        if key not in known:
            raise UserError(f"{source}: unknown config key {key!r}{closest(str(key), known)}")


# ---------------------------------------------------------------------------------------------
# Rollout importance sampling (``rollout_is``): three threshold conventions -> one canonical form
# ---------------------------------------------------------------------------------------------
#
# Trainers write the same band three ways: xtuner tuples ``(upper, lower)``, verl strings
# ``"lower_upper"`` (a bare number is an upper cap), OpenRLHF-style lists ``[low, high]``. Which
# convention a 2-element list follows is decided by the key that holds it (JSON has no tuples):
# the xtuner keys ``rollout_is*_threshold`` hold ``(upper, lower)``, grpolens' own ``*threshold``
# keys hold ``[low, high]``. ``None`` for a bound means "no bound on that side".

_TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
_RIS_KEYS = {
    # grpolens
    "level", "mode", "lower", "upper", "threshold", "mask_lower", "mask_upper", "mask_threshold",
    "veto_lower", "veto_upper", "veto_threshold", "rs", "rs_threshold",
    # xtuner (and verl: rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold)
    "rollout_is_level", "rollout_is_mode", "rollout_is_threshold", "rollout_is_mask_threshold",
    "rollout_is_veto_threshold", "rollout_is", "rollout_rs", "rollout_rs_threshold",
    # verl
    "rollout_is_batch_normalize", "batch_normalize",
    # TRL
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_cap",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
}


def _ris_number(key: str, v: Any, *, allow_zero: bool) -> float:
    if isinstance(v, bool) or v is None:
        raise _bad(key, "must be a positive number", v)
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise _bad(key, "must be a positive number", v) from None
    if not (x == x) or x < 0 or (x == 0 and not allow_zero) or x == float("inf"):
        raise _bad(key, "must be a finite number > 0" + (" (0 disables that side)" if allow_zero else ""), v)
    return x


def _check_pair(key: str, lower: float | None, upper: float | None, shown: Any, hint: str = "") -> tuple[float | None, float | None]:
    if lower is not None and upper is not None and not lower < upper:
        raise _bad(key, f"bounds are inverted or empty: lower {lower:g} must be < upper {upper:g}{hint}", shown)
    return lower, upper


def parse_threshold(key: str, value: Any, convention: str) -> tuple[float | None, float | None]:
    """One threshold value -> ``(lower, upper)``; ``convention`` is how a 2-element list is read:
    ``"upper_lower"`` (xtuner tuples) or ``"lower_upper"`` (``[low, high]`` lists).

    Strings follow verl: ``"lo_hi"`` is a band, ``"2.0"`` an upper cap (like a bare number).
    A mapping ``{lower, upper}`` is taken as is. Lower bounds may be 0 (that side is disabled).
    """
    if convention not in ("upper_lower", "lower_upper"):
        raise ValueError(f"parse_threshold: unknown convention {convention!r}")  # a caller's mistake, not the user's
    if value is None:
        return None, None
    if isinstance(value, bool):
        raise _bad(key, "must be a number, a 'lower_upper' string or a pair, not a boolean", value)
    if isinstance(value, dict):
        unknown = set(value) - {"lower", "upper"}
        if unknown:
            raise _bad(key, f"a mapping takes only 'lower' and 'upper' (unknown: {', '.join(sorted(unknown))})", value)
        lo = None if value.get("lower") is None else _ris_number(key, value["lower"], allow_zero=True)
        hi = None if value.get("upper") is None else _ris_number(key, value["upper"], allow_zero=False)
        return _check_pair(key, lo, hi, value)
    if isinstance(value, str):
        text = value.strip()
        if "_" in text:
            parts = text.split("_")
            if len(parts) != 2:
                raise _bad(key, "a band string is 'lower_upper', e.g. '0.5_5.0'", value)
            lo = _ris_number(key, parts[0], allow_zero=False)
            hi = _ris_number(key, parts[1], allow_zero=False)
            return _check_pair(key, lo, hi, value, " (verl strings are 'lower_upper')")
        return None, _ris_number(key, text, allow_zero=False)
    if isinstance(value, (int, float)):
        return None, _ris_number(key, value, allow_zero=False)
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise _bad(key, "a threshold pair has exactly two numbers", value)
        if convention == "upper_lower":
            hi = _ris_number(key, value[0], allow_zero=False)
            lo = _ris_number(key, value[1], allow_zero=True)
            return _check_pair(key, lo, hi, value, f" (xtuner tuples are (upper, lower): did you mean ({value[1]}, {value[0]})?)")
        lo = _ris_number(key, value[0], allow_zero=True)
        hi = _ris_number(key, value[1], allow_zero=False)
        return _check_pair(key, lo, hi, value, f" ([low, high] lists: did you mean [{value[1]}, {value[0]}]?)")
    raise _bad(key, "must be a number, a 'lower_upper' string, a pair or {lower, upper}", value)


def _rs_filters(key: str, options: Any, thresholds: Any, tkey: str) -> list[dict]:
    """verl's rejection filters: comma-separated options, thresholds broadcast or one per option."""
    if options is None or options == "" or options == []:
        return []
    if isinstance(options, (list, tuple)) and all(isinstance(o, dict) for o in options):
        # already canonical ({option, lower, upper} per filter): check it again
        return [f for o in options for f in _rs_filters(key, [o.get("option")], [
            {"lower": o.get("lower"), "upper": o.get("upper")}], tkey)]
    if isinstance(options, str):
        opts = [o.strip() for o in options.split(",") if o.strip()]
    elif isinstance(options, (list, tuple)) and all(isinstance(o, str) for o in options):
        opts = [o.strip() for o in options]
    else:
        raise _bad(key, "must be option names, e.g. 'token_k1,seq_max_k3'", options)
    opts = list(dict.fromkeys(opts))  # de-duplicated, order kept (as verl)
    bad = [o for o in opts if o not in RS_OPTIONS]
    if bad:
        raise _bad(key, f"unknown rejection option(s) {', '.join(bad)}; choose from {', '.join(RS_OPTIONS)}", options)
    if thresholds is None:
        raise _bad(tkey, f"{key} needs thresholds (one, or one per option)", thresholds)
    if isinstance(thresholds, str):
        ths = [t.strip() for t in thresholds.split(",")]
    elif isinstance(thresholds, (list, tuple)):
        ths = list(thresholds)
    else:
        ths = [thresholds]
    if len(ths) == 1:
        ths = ths * len(opts)
    if len(ths) != len(opts):
        raise _bad(tkey, f"give one threshold or one per option ({len(opts)})", thresholds)
    out = []
    for opt, th in zip(opts, ths):
        if isinstance(th, dict) and not opt.endswith("k1"):
            th = th.get("upper")
        if opt.endswith("k1"):
            lo, hi = parse_threshold(f"{tkey} ({opt})", th, "lower_upper")
            if lo is None:
                lo = 1.0 / hi  # a single value h means the band [1/h, h]
            if lo <= 0:
                raise _bad(f"{tkey} ({opt})", "k1 bounds must be > 0", th)
        else:
            if isinstance(th, str) and "_" in th:
                raise _bad(f"{tkey} ({opt})", "k2/k3 filters take a single upper bound, not a band", th)
            lo, hi = None, parse_threshold(f"{tkey} ({opt})", th, "lower_upper")[1]
            if hi is None:
                raise _bad(f"{tkey} ({opt})", "k2/k3 filters take a single upper bound", th)
        out.append({"option": opt, "lower": lo, "upper": hi})
    return out


def normalize_rollout_is(value: Any, key: str = "rollout_is") -> dict[str, Any] | None:
    """``cfg["rollout_is"]`` in any accepted spelling -> the canonical mapping (or None: not configured)::

        {level, mode, lower, upper, mask_lower, mask_upper, veto_lower, veto_upper, rs: [...]}

    Modes: ``none`` (weights reported, nothing changed), ``truncate`` (clamp to [lower, upper], the
    xtuner reference), ``truncate_upper`` (clamp at upper only: verl TIS, TRL), ``mask`` (reject
    tokens/sequences outside [mask_lower, mask_upper]), ``both`` (mask + truncate), ``icepop``
    (zero weights outside [lower, upper], keep the tokens: verl IcePop, TRL ``*_mask``).
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(key, "must be a mapping of rollout IS settings (or null)", value)
    unknown = sorted(set(value) - _RIS_KEYS)
    if unknown:
        raise _bad(key, f"unknown setting(s) {', '.join(unknown)}{closest(str(unknown[0]), _RIS_KEYS)}; "
                        f"accepted: {', '.join(sorted(_RIS_KEYS))}", value)
    k = lambda name: f"{key}.{name}"  # noqa: E731
    v = dict(value)
    if v.get("vllm_importance_sampling_correction") is False:
        return None
    xtuner_style = any(n in v for n in ("rollout_is_level", "rollout_is_mode", "rollout_is_mask_threshold",
                                        "rollout_is_veto_threshold")) or isinstance(v.get("rollout_is_threshold"), (list, tuple))
    if xtuner_style and v.get("rollout_is_threshold") is None:
        return None  # xtuner ignores every other setting (veto too) when rollout_is_threshold is unset

    # -- level and mode ----------------------------------------------------------------------
    level = v.get("level", v.get("rollout_is_level"))
    verl_level = v.get("rollout_is")
    if verl_level is not None:
        if level is not None and level != verl_level:
            raise _bad(k("rollout_is"), f"conflicts with level {level!r}", verl_level)
        level = verl_level
    mode = v.get("mode", v.get("rollout_is_mode"))
    trl_mode = v.get("vllm_importance_sampling_mode")
    if mode in _TRL_MODES and trl_mode is None:
        trl_mode, mode = mode, None
    # (what the message calls it, the key of its upper bound, (lower, upper)) of each spelling given
    sources: list[tuple[str, str, tuple[float | None, float | None]]] = []
    if trl_mode is not None:
        if trl_mode not in _TRL_MODES:
            raise _bad(k("vllm_importance_sampling_mode"), f"must be one of {', '.join(_TRL_MODES)}", trl_mode)
        tl, _, tm = trl_mode.partition("_")
        level = level or tl
        if level != tl:
            raise _bad(k("vllm_importance_sampling_mode"), f"conflicts with level {level!r}", trl_mode)
        mode = mode or ("truncate" if tm == "truncate" else "icepop")
        hi = v.get("vllm_importance_sampling_clip_max", v.get("vllm_importance_sampling_cap", 3.0))
        lo = v.get("vllm_importance_sampling_clip_min")
        sources.append(("vllm_importance_sampling_clip_min/clip_max", "vllm_importance_sampling_clip_max", parse_threshold(
            k("vllm_importance_sampling_clip_max"), {"lower": lo, "upper": hi}, "lower_upper")))
    level = level or "token"
    if level not in ("token", "sequence", "geometric"):
        raise _bad(k("level"), "must be one of token, sequence, geometric", level)

    # -- the IS band -------------------------------------------------------------------------
    rt = v.get("rollout_is_threshold")
    if rt is not None:
        pair = parse_threshold(k("rollout_is_threshold"), rt, "upper_lower")
        sources.append(("rollout_is_threshold", "rollout_is_threshold", pair))
        if mode is None and not xtuner_style:  # verl: a number caps (TIS), a band zeroes (IcePop)
            mode = "truncate_upper" if pair[0] is None else "icepop"
            if pair[0] is None:
                pair = (1.0 / pair[1], pair[1])  # verl's lower bound for its fraction_low metrics
                sources[-1] = ("rollout_is_threshold", "rollout_is_threshold", pair)
    if v.get("threshold") is not None:
        sources.append(("threshold", "threshold", parse_threshold(k("threshold"), v["threshold"], "lower_upper")))
    if v.get("lower") is not None or v.get("upper") is not None:
        sources.append(("lower/upper", "upper", parse_threshold(k("upper"), {"lower": v.get("lower"), "upper": v.get("upper")}, "lower_upper")))
    if len(sources) > 1:
        raise _bad(key, f"the IS band is given twice ({' and '.join(s for s, _, _ in sources)}); keep one", value)
    lower, upper = sources[0][2] if sources else (None, None)
    if lower is not None and upper is None:
        raise _bad(k("upper"), "a lower bound needs an upper bound", value)
    if upper is not None and upper < _SMALLEST_WEIGHT:
        # A smaller bound caps or zeroes every weight; below ~1.6e-162 its square would also underflow
        # in the Σw² partials and leave the ESS undefined.
        raise _bad(k(sources[0][1]),
                   f"the upper IS bound must be at least exp(-{LOG_RATIO_BOUND:g}) = {_SMALLEST_WEIGHT:.3g}, the "
                   f"smallest weight there is (log-ratios are clipped to ±{LOG_RATIO_BOUND:g} before exp)", upper)

    mask_lower, mask_upper = lower, upper
    for name, conv in (("mask_threshold", "lower_upper"), ("rollout_is_mask_threshold", "upper_lower")):
        if v.get(name) is not None:
            mask_lower, mask_upper = parse_threshold(k(name), v[name], conv)
    if v.get("mask_lower") is not None or v.get("mask_upper") is not None:
        mask_lower, mask_upper = parse_threshold(k("mask_upper"), {"lower": v.get("mask_lower"), "upper": v.get("mask_upper")}, "lower_upper")
    veto_lower = veto_upper = None
    for name, conv in (("veto_threshold", "lower_upper"), ("rollout_is_veto_threshold", "upper_lower")):
        if v.get(name) is not None:
            veto_lower, veto_upper = parse_threshold(k(name), v[name], conv)
    if v.get("veto_lower") is not None:
        veto_lower = _ris_number(k("veto_lower"), v["veto_lower"], allow_zero=True)
    if v.get("veto_upper") is not None:
        veto_upper = _ris_number(k("veto_upper"), v["veto_upper"], allow_zero=False)
    _check_pair(k("veto_lower"), veto_lower, veto_upper, value)

    if mode is None:
        mode = "truncate" if upper is not None else "none"
    if mode not in IS_MODES:
        raise _bad(k("mode"), f"must be one of {', '.join(IS_MODES)} (or a TRL mode: {', '.join(_TRL_MODES)})", mode)
    if mode in ("truncate", "truncate_upper", "both", "icepop") and upper is None:
        raise _bad(k("upper"), f"mode {mode!r} needs an upper threshold", value)
    if mode in ("mask", "both") and mask_upper is None:
        raise _bad(k("mask_upper"), f"mode {mode!r} needs a mask band (mask_upper, or the IS band)", value)

    rs = _rs_filters(k("rs"), v.get("rs", v.get("rollout_rs")), v.get("rs_threshold", v.get("rollout_rs_threshold")),
                     k("rs_threshold"))
    out = {"level": level, "mode": mode, "lower": lower, "upper": upper, "mask_lower": mask_lower,
           "mask_upper": mask_upper, "veto_lower": veto_lower, "veto_upper": veto_upper, "rs": rs}
    bn = v.get("batch_normalize", v.get("rollout_is_batch_normalize", False))
    if not isinstance(bn, bool):
        raise _bad(k("batch_normalize"), "must be true or false", bn)
    if bn:  # verl: the applied weights divided by their batch mean (absent: false)
        out["batch_normalize"] = True
    return out
