"""The default profile: every metric under its canonical name, token means pooled over the step."""

from grpolens.metrics.profile import Profile, register_profile

PROFILE = register_profile(Profile(
    "grpolens", "canonical names, exact pooled values", canonical=True,
    token_mean="pooled", extrema="over the step", empty="null",
))
