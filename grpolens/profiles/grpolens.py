"""The default profile: every metric under its canonical name, token means pooled over the step."""

from grpolens.metrics.profile import Profile, register_profile

PROFILE = register_profile(Profile(
    "grpolens", "canonical names, exact pooled values", canonical=True,
    token_mean="pooled", extrema="over the step", empty="null",
    # the run config's own keys (docs/run-format.md), which the hook and synth write
    settings={"clip_low": "epsilon", "clip_high": "epsilon_high", "kl_coef": "beta",
              "num_iterations": "num_iterations", "num_generations": "num_generations",
              "max_completion_length": "max_completion_length", "temperature": "temperature",
              "rollout_is": "rollout_is", "overlong": "mask_truncated_completions",
              "reward_weights": "reward_weights"},
))
