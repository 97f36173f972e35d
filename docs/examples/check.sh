# two short "training runs" of the same job: a good one, and one whose KL to the reference spikes at step 12
grpolens synth good --steps 16 --seed 3
grpolens synth ci --steps 16 --seed 4 --inject kl-spike@12
# the built-in rules need no baseline: the good run passes (exit 0)
grpolens check good
# the spike fails the build with exit 1, naming step 12 and the command to drill into it
status=0; grpolens check ci --junit reports/check.xml --github || status=$?; test "$status" -eq 1
# your own rules against golden values written once from a good run; append the job summary
grpolens check good --rules "$GRPOLENS_REPO/docs/examples/ci-rules.toml" --write-golden golden.json -q
status=0; grpolens check ci --rules "$GRPOLENS_REPO/docs/examples/ci-rules.toml" --baseline golden.json \
    --summary-md summary.md || status=$?; test "$status" -eq 1
# the built-in rules as TOML: a starting point for your own rules file
grpolens check good --show-rules > my-rules.toml
grpolens check good --rules my-rules.toml --show-rules
