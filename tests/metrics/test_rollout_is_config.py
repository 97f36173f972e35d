"""The rollout-IS settings: every trainer's spelling of them (TRL, verl, xtuner, grpolens' own
keys) normalised to one mapping, and every refusal of a bad one as one exact line naming its key
(``grpolens.run.config.normalize_rollout_is``; the metrics they drive are in test_rollout_is.py)."""

import numpy as np
import pytest

from grpolens.errors import UserError
from grpolens.run.config import normalize_rollout_is
from tests.refdata import random_calls, write_run


@pytest.mark.parametrize("spec,band", [
    ({"rollout_is_threshold": [2.0, 0.5]}, (0.5, 2.0)),          # xtuner (upper, lower)
    ({"rollout_is_threshold": "0.5_2.0"}, (0.5, 2.0)),           # verl "lower_upper"
    ({"threshold": [0.5, 2.0]}, (0.5, 2.0)),                     # [low, high]
    ({"threshold": {"lower": 0.5, "upper": 2.0}}, (0.5, 2.0)),
    ({"lower": 0.5, "upper": 2.0}, (0.5, 2.0)),
    ({"rollout_is_threshold": [5, 0]}, (0.0, 5.0)),              # xtuner: lower 0 disables that side
    ({"upper": 3.0}, (None, 3.0)),
])
def test_threshold_conventions(spec, band):
    got = normalize_rollout_is(spec)
    assert (got["lower"], got["upper"]) == band


@pytest.mark.parametrize("spec,match", [
    ({"rollout_is_threshold": [0.5, 2.0]}, r"rollout_is_threshold.*\(upper, lower\)"),
    ({"threshold": [2.0, 0.5]}, r"'rollout_is.threshold'.*inverted"),
    ({"rollout_is_threshold": "2.0_0.5"}, r"lower_upper"),
    ({"rollout_is_threshold": "0_2"}, r"> 0"),
    ({"upper": 0}, r"rollout_is.upper"),
    ({"threshold": [-1, 2]}, r"threshold"),
    ({"rollout_is_threshold": True}, r"boolean"),
    ({"veto_threshold": [1e4, 1e-4]}, r"veto_threshold.*inverted"),
    ({"mode": "truncate"}, r"needs an upper"),
    ({"level": "tokens"}, r"rollout_is.level"),
    ({"rs": "token_k4", "rs_threshold": 2}, r"unknown rejection option"),
    ({"rs": "token_k2", "rs_threshold": "0.5_2"}, r"single upper bound"),
    ({"rs": "token_k1,seq_max_k2", "rs_threshold": "1,2,3"}, r"one per option"),
    ({"threshold": [0.5, 2], "upper": 3}, r"given twice"),
    ({"bogus": 1}, r"unknown setting"),
    ({"threshold": [0, 1e-10]}, r"'rollout_is.threshold'.*at least exp\(-20\)"),
    ({"upper": 1e-170}, r"'rollout_is.upper'.*at least exp\(-20\)"),
    ({"rollout_is_threshold": 1e-12}, r"'rollout_is.rollout_is_threshold'.*at least"),
    ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 1e-12},
     r"'rollout_is.vllm_importance_sampling_clip_max'.*at least"),
])
def test_threshold_errors(spec, match):
    with pytest.raises(UserError, match=match):
        normalize_rollout_is(spec)


def _ris(level, mode, lower, upper, mask=None, veto=(None, None), rs=(), **extra):
    mask = (lower, upper) if mask is None else mask
    return {"level": level, "mode": mode, "lower": lower, "upper": upper, "mask_lower": mask[0], "mask_upper": mask[1],
            "veto_lower": veto[0], "veto_upper": veto[1], "rs": list(rs), **extra}


@pytest.mark.parametrize("spec,want", [
    # TRL: the mode names the level; *_truncate caps, *_mask zeroes (IcePop); the cap defaults to 3
    ({"vllm_importance_sampling_mode": "token_truncate"}, _ris("token", "truncate", None, 3.0)),
    ({"mode": "token_mask"}, _ris("token", "icepop", None, 3.0)),
    ({"vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_min": 0.5,
      "vllm_importance_sampling_clip_max": 2.0}, _ris("sequence", "icepop", 0.5, 2.0)),
    ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_cap": 5.0},
     _ris("token", "truncate", None, 5.0)),
    ({"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_truncate"},
     _ris("sequence", "truncate", None, 3.0)),
    ({"vllm_importance_sampling_correction": False, "vllm_importance_sampling_mode": "sequence_truncate"}, None),
    # verl: a number caps (TIS, lower 1/upper for its metrics), a band string zeroes (IcePop)
    ({"rollout_is": "sequence", "rollout_is_threshold": 2.0}, _ris("sequence", "truncate_upper", 0.5, 2.0)),
    ({"rollout_is_threshold": "0.5_5.0"}, _ris("token", "icepop", 0.5, 5.0)),
    ({"rollout_rs": "token_k1,seq_max_k3", "rollout_rs_threshold": "0.5_2.0,3.0"},
     _ris("token", "none", None, None, rs=[{"option": "token_k1", "lower": 0.5, "upper": 2.0},
                                           {"option": "seq_max_k3", "lower": None, "upper": 3.0}])),
    ({"rollout_is_batch_normalize": True, "upper": 2}, _ris("token", "truncate", None, 2.0, batch_normalize=True)),
    # xtuner: (upper, lower) tuples; any of its keys makes a bare threshold a plain truncation
    ({"rollout_is_level": "geometric", "rollout_is_mode": "both", "rollout_is_threshold": [2.0, 0.5],
      "rollout_is_mask_threshold": [3.0, 0.3], "rollout_is_veto_threshold": [1e4, 1e-4]},
     _ris("geometric", "both", 0.5, 2.0, mask=(0.3, 3.0), veto=(1e-4, 1e4))),
    ({"rollout_is_level": "token", "rollout_is_threshold": 2.0}, _ris("token", "truncate", None, 2.0)),
    ({"rollout_is_mask_threshold": [3, 0.3], "rollout_is_threshold": 2.0},
     _ris("token", "truncate", None, 2.0, mask=(0.3, 3.0))),
    ({"rollout_is_veto_threshold": [1e4, 1e-4], "rollout_is_threshold": 2.0},
     _ris("token", "truncate", None, 2.0, veto=(1e-4, 1e4))),
    # grpolens' own keys
    ({"level": "token", "mode": "mask", "mask_lower": 0.2, "mask_upper": 5}, _ris("token", "mask", None, None, mask=(0.2, 5.0))),
    ({"mask_threshold": [0.2, 5], "veto_lower": 1e-3, "veto_upper": 1e3},
     _ris("token", "none", None, None, mask=(0.2, 5.0), veto=(1e-3, 1e3))),
    ({"mode": "mask", "mask_upper": 5}, _ris("token", "mask", None, None, mask=(None, 5.0))),  # one side given
    ({"mask_lower": 0.2, "upper": 2.0}, _ris("token", "truncate", None, 2.0, mask=(0.2, None))),
    ({"veto_lower": 0, "veto_upper": 10}, _ris("token", "none", None, None, veto=(0.0, 10.0))),  # 0: that side off
])
def test_every_trainers_spelling_normalises_to_one_mapping(spec, want):
    assert normalize_rollout_is(spec) == want


@pytest.mark.parametrize("key,value", [("rollout_is_level", "token"), ("rollout_is_mode", "truncate"),
                                       ("rollout_is_mask_threshold", [2, 0.5]), ("rollout_is_veto_threshold", [1e4, 1e-4])])
def test_an_xtuner_setting_without_its_threshold_turns_the_correction_off(key, value):
    """xtuner ignores every rollout-IS setting, the veto too, while rollout_is_threshold is unset."""
    assert normalize_rollout_is({key: value}) is None


_ACCEPTED = ("batch_normalize, level, lower, mask_lower, mask_threshold, mask_upper, mode, rollout_is, "
             "rollout_is_batch_normalize, rollout_is_level, rollout_is_mask_threshold, rollout_is_mode, "
             "rollout_is_threshold, rollout_is_veto_threshold, rollout_rs, rollout_rs_threshold, rs, rs_threshold, "
             "threshold, upper, veto_lower, veto_threshold, veto_upper, vllm_importance_sampling_cap, "
             "vllm_importance_sampling_clip_max, vllm_importance_sampling_clip_min, "
             "vllm_importance_sampling_correction, vllm_importance_sampling_mode")


@pytest.mark.parametrize("spec,message", [
    ([1], "config key 'rollout_is': must be a mapping of rollout IS settings (or null), got [1]"),
    ({"zz": 2, "bogus": 1},
     f"config key 'rollout_is': unknown setting(s) bogus, zz; accepted: {_ACCEPTED}, got {{'zz': 2, 'bogus': 1}}"),
    ({"level": "token", "rollout_is": "sequence"},
     "config key 'rollout_is.rollout_is': conflicts with level 'token', got 'sequence'"),
    ({"vllm_importance_sampling_mode": "token"},
     "config key 'rollout_is.vllm_importance_sampling_mode': must be one of token_truncate, token_mask, "
     "sequence_truncate, sequence_mask, got 'token'"),
    ({"level": "sequence", "vllm_importance_sampling_mode": "token_mask"},
     "config key 'rollout_is.vllm_importance_sampling_mode': conflicts with level 'sequence', got 'token_mask'"),
    ({"level": "tokens"}, "config key 'rollout_is.level': must be one of token, sequence, geometric, got 'tokens'"),
    ({"threshold": [0.5, 2], "upper": 3},
     "config key 'rollout_is': the IS band is given twice (threshold and lower/upper); keep one, "
     "got {'threshold': [0.5, 2], 'upper': 3}"),
    ({"lower": 0.5}, "config key 'rollout_is.upper': a lower bound needs an upper bound, got {'lower': 0.5}"),
    ({"upper": 1e-9}, "config key 'rollout_is.upper': the upper IS bound must be at least exp(-20) = 2.06e-09, the "
                      "smallest weight there is (log-ratios are clipped to ±20 before exp), got 1e-09"),
    ({"mode": "clip", "upper": 2},
     "config key 'rollout_is.mode': must be one of none, truncate, truncate_upper, mask, both, icepop (or a TRL mode: "
     "token_truncate, token_mask, sequence_truncate, sequence_mask), got 'clip'"),
    ({"mode": "icepop"}, "config key 'rollout_is.upper': mode 'icepop' needs an upper threshold, got {'mode': 'icepop'}"),
    ({"mode": "mask"},
     "config key 'rollout_is.mask_upper': mode 'mask' needs a mask band (mask_upper, or the IS band), got {'mode': 'mask'}"),
    ({"batch_normalize": "yes"}, "config key 'rollout_is.batch_normalize': must be true or false, got 'yes'"),
    ({"rollout_is_threshold": "0.5_2.0", "upper": 3},
     "config key 'rollout_is': the IS band is given twice (rollout_is_threshold and lower/upper); keep one, "
     "got {'rollout_is_threshold': '0.5_2.0', 'upper': 3}"),
    ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": -1},
     "config key 'rollout_is.vllm_importance_sampling_clip_max': must be a finite number > 0, got -1"),
    ({"mask_threshold": [2, 0.5]}, "config key 'rollout_is.mask_threshold': bounds are inverted or empty: lower 2 "
                                   "must be < upper 0.5 ([low, high] lists: did you mean [0.5, 2]?), got [2, 0.5]"),
    ({"rollout_is_threshold": [2.0, 0.5], "rollout_is_mask_threshold": [0.5, 2]},
     "config key 'rollout_is.rollout_is_mask_threshold': bounds are inverted or empty: lower 2 must be < upper 0.5 "
     "(xtuner tuples are (upper, lower): did you mean (2, 0.5)?), got [0.5, 2]"),
    ({"mask_lower": 5, "mask_upper": 2}, "config key 'rollout_is.mask_upper': bounds are inverted or empty: lower 5 "
                                         "must be < upper 2, got {'lower': 5, 'upper': 2}"),
    ({"veto_lower": -1}, "config key 'rollout_is.veto_lower': must be a finite number > 0 (0 disables that side), got -1"),
    ({"veto_upper": 0}, "config key 'rollout_is.veto_upper': must be a finite number > 0, got 0"),
    ({"veto_lower": 10, "veto_upper": 1}, "config key 'rollout_is.veto_lower': bounds are inverted or empty: lower 10 "
                                          "must be < upper 1, got {'veto_lower': 10, 'veto_upper': 1}"),
    ({"mode": "truncate_upper"},
     "config key 'rollout_is.upper': mode 'truncate_upper' needs an upper threshold, got {'mode': 'truncate_upper'}"),
    ({"mode": "both", "mask_upper": 3},
     "config key 'rollout_is.upper': mode 'both' needs an upper threshold, got {'mode': 'both', 'mask_upper': 3}"),
    ({"mode": "both", "upper": 2, "mask_lower": 0.5},
     "config key 'rollout_is.mask_upper': mode 'both' needs a mask band (mask_upper, or the IS band), "
     "got {'mode': 'both', 'upper': 2, 'mask_lower': 0.5}"),
    ({"rs": "token_k4", "rs_threshold": 2},
     "config key 'rollout_is.rs': unknown rejection option(s) token_k4; choose from token_k1, token_k2, token_k3, "
     "seq_sum_k1, seq_sum_k2, seq_sum_k3, seq_mean_k1, seq_mean_k2, seq_mean_k3, seq_max_k2, seq_max_k3, got 'token_k4'"),
    ({"rs": "token_k1"},
     "config key 'rollout_is.rs_threshold': rollout_is.rs needs thresholds (one, or one per option), got None"),
])
def test_each_refusal_names_its_key_the_reason_and_the_value(spec, message):
    with pytest.raises(UserError) as e:
        normalize_rollout_is(spec)
    assert e.value.message == message


def test_refusals_name_the_key_the_settings_came_from():
    with pytest.raises(UserError) as e:
        normalize_rollout_is({"level": "tokens"}, key="variants.a.rollout_is")
    assert e.value.message.startswith("config key 'variants.a.rollout_is.level': must be one of")
    with pytest.raises(UserError) as e:
        normalize_rollout_is("token", key="variants.a.rollout_is")
    assert e.value.message.startswith("config key 'variants.a.rollout_is': must be a mapping")


def test_the_smallest_upper_bound_is_the_smallest_weight():
    # Every weight is at least exp(-20) (the safety bound); a bound exactly there is the smallest allowed.
    # (Below it every weight is capped; far below, the squares underflow and the ESS is undefined.)
    smallest = float(np.exp(-20.0))
    assert normalize_rollout_is({"upper": smallest})["upper"] == smallest
    with pytest.raises(UserError, match="at least"):
        normalize_rollout_is({"upper": np.nextafter(smallest, 0.0)})


def test_threshold_error_from_cli(tmp_path, capsys):
    from grpolens.cli import main

    run = write_run(tmp_path / "run", random_calls(np.random.default_rng(0)),
                    config={"rollout_is": {"rollout_is_threshold": [0.5, 2.0]}})
    with pytest.raises(SystemExit) as e:
        main(["recompute", str(run), "-q"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "rollout_is.rollout_is_threshold" in err and "Traceback" not in err


def test_normalisation_is_idempotent():
    spec = {"rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0", "rollout_rs": "token_k1,seq_max_k3",
            "rollout_rs_threshold": "0.4_1.8,3.0", "veto_threshold": [1e-4, 1e4]}
    once = normalize_rollout_is(spec)
    assert normalize_rollout_is(once) == once
    assert once["rs"] == [{"option": "token_k1", "lower": 0.4, "upper": 1.8},
                          {"option": "seq_max_k3", "lower": None, "upper": 3.0}]
