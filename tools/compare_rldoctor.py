"""grpolens doctor beside rldoctor on the same runs: the injected synthetic runs, their clean twin
and sample_runs/trl-tiny.

    python -m venv /tmp/rldoctor-venv && /tmp/rldoctor-venv/bin/pip install rldoctor==0.2.0
    PYTHONPATH=. python tools/compare_rldoctor.py --rldoctor /tmp/rldoctor-venv/bin/rl-doctor [--steps 40 --at 20 --seed 0]

rldoctor reads scalar logs (JSONL with trainer key names): each run is exported with
``grpolens recompute RUN --profile trl --per-step`` (TRL's names, one row per optimizer step), its
``metrics.jsonl`` given to ``rl-doctor diagnose --format json``, and the same run to ``grpolens
doctor``. Prints, per run, the warning-or-worse findings of each (ids) and rldoctor's detector
names. rldoctor is never installed into grpolens' environment (its own venv, a subprocess).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from grpolens.adapters.synth import PATHOLOGIES, synth_run
from grpolens.analysis.doctor import diagnose
from grpolens.analysis.recompute import recompute

ROOT = Path(__file__).resolve().parents[1]


def rldoctor_findings(exe: str, jsonl: Path) -> list[str]:
    r = subprocess.run([exe, "diagnose", str(jsonl), "--format", "json", "--no-color"], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        return [f"error: {(r.stderr or r.stdout).strip().splitlines()[-1][:120]}"]
    out = json.loads(r.stdout)
    found = out.get("findings") or []
    # its statuses: OK (looked, nothing), SKIPPED (could not look), INFO / WARNING / CRITICAL
    return sorted({f"{f.get('detector', f.get('id', '?'))}:{f.get('severity', '?')}" for f in found
                   if str(f.get("severity", "")).upper() not in ("OK", "SKIPPED")})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rldoctor", default="/tmp/rldoctor-venv/bin/rl-doctor")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--at", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="rldoctor-cmp-"))
    try:
        runs = {"clean": synth_run(tmp / "clean", steps=a.steps, seed=a.seed)}
        for kind in PATHOLOGIES:
            runs[f"{kind}@{a.at}"] = synth_run(tmp / kind, steps=a.steps, seed=a.seed, inject=[f"{kind}@{a.at}"])
        runs["trl-tiny"] = shutil.copytree(ROOT / "sample_runs" / "trl-tiny", tmp / "trl-tiny")
        print("| run | grpolens doctor (warning+) | rldoctor |")
        print("|---|---|---|")
        for name, run in runs.items():
            recompute(run, profile="trl", per_step=True)
            rep = diagnose(run, explain=False)
            ours = sorted({f"{f.id}:{f.severity}" for f in rep.findings if f.severity != "info"})
            theirs = rldoctor_findings(a.rldoctor, Path(run) / "grpolens" / "trl" / "metrics.jsonl")
            print(f"| {name} | {', '.join(ours) or '—'} | {', '.join(theirs) or '—'} |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
