# a run whose engine starts sampling at another temperature at step 20, and a clean one of the same seed
grpolens synth drift --steps 40 --seed 0 --inject rollout-drift@20
grpolens synth clean --steps 40 --seed 0
# the findings for a person: each detector passed, skipped (why) or fired, each finding with its fix
grpolens doctor drift
# for CI: exit 1 when a warning or worse exists, 0 otherwise
status=0; grpolens doctor drift --fail-on warning || status=$?; test "$status" -eq 1
grpolens doctor clean --fail-on warning
# for scripts and the dashboard: one JSON object {"run", "findings", "detectors"}
grpolens doctor drift --json --no-explain > findings.json
python -c "import json; r = json.load(open('findings.json')); assert r['findings'][0]['id'] == 'rollout-drift'"
# the bundled real TRL run: suggestions in TRL's own setting names, info findings only
grpolens doctor sample_runs/trl-tiny --fail-on warning
