"""Applications over a run: recompute, rollout-IS sweeps, token drill-down, sidecars, parity."""
