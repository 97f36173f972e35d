"""What GRPOLensTrainer costs per optimizer step on CPU: the tiny TRL run with and without it.

    python tests/integration/bench_trl.py [--steps 20] [--repeats 3] [--max-completion-length 32] [--write-doc]

Alternates runs with and without grpolens in one process (same seed, same work) and prints the
median ``train()`` wall time per optimizer step of each, their difference, and the run's size.
Not a test: timings depend on the machine and its load. ``--write-doc`` writes the table, with the
machine and the date, into docs/integrations/trl.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
from pathlib import Path


def run_shape(run: Path) -> str:
    """What one optimizer step of the recorded run holds, read from its shards (the doc describes the
    measured run from the run itself)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from grpolens.run import format as fmt

    def read(table, columns):
        return pa.concat_tables(pq.read_table(sh.path, columns=columns) for sh in fmt.list_shards(run, table))

    tok = read(fmt.TOKENS, ["step", "rank", "micro_batch", "sample_id"])
    calls = tok.group_by(["step", "rank", "micro_batch"]).aggregate([("sample_id", "count_distinct")])
    per_step = calls.group_by(["step"]).aggregate([("micro_batch", "count")])
    sam = read(fmt.SAMPLES, ["step", "completion_len"])
    gens = sam.group_by(["step"]).aggregate([("completion_len", "count")])
    return (f"Run measured: {pc.max(per_step['micro_batch_count']).as_py()} loss calls per optimizer step of at most "
            f"{pc.max(calls['sample_id_count_distinct']).as_py()} completions each, the longest "
            f"{pc.max(sam['completion_len']).as_py()} tokens; "
            f"{pc.max(gens['completion_len_count']).as_py()} completions per generation, "
            f"generated at {gens.num_rows} of its {per_step.num_rows} steps.")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--write-doc", action="store_true", help="write the table into docs/integrations/trl.md")
    a = p.parse_args()
    started = dt.datetime.now(dt.timezone.utc)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import time

    from grpolens.integrations import trl as gl_trl
    from tests.integration import trl_tiny

    # CPU time of the training thread inside grpolens' own code (robust to other load on the box)
    spent = {"loss_call": 0.0, "generation": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.thread_time() - t0
        return wrapper

    gl_trl.GRPOLensMixin._grpolens_record_loss_call = timed("loss_call", gl_trl.GRPOLensMixin._grpolens_record_loss_call)
    gl_trl.GRPOLensMixin._grpolens_record_generation = timed("generation", gl_trl.GRPOLensMixin._grpolens_record_generation)

    times: dict[str, list[float]] = {"with": [], "without": []}
    cpu: dict[str, list[float]] = {"with": [], "without": []}  # whole process (all threads), incl. model build
    size = 0
    calls = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for mode in ("without", "with"):
                out = Path(tmp) / f"{mode}{i}"
                args = [str(out), "--max-steps", str(a.steps), "--max-completion-length", str(a.max_completion_length)]
                c0 = time.process_time()
                trl_tiny.main(args + (["--no-grpolens"] if mode == "without" else []))
                cpu[mode].append((time.process_time() - c0) / a.steps)
                res = json.loads((out / "result.json").read_text())
                times[mode].append(res["train_seconds"] / a.steps)
                if mode == "with":
                    files = list((out / "run").rglob("*.parquet"))
                    size = sum(f.stat().st_size for f in files)
                    calls = len(list((out / "run" / "tokens").glob("step=*")))
                    shape = run_shape(out / "run")
    w, wo = statistics.median(times["with"]), statistics.median(times["without"])
    n_steps = a.steps * a.repeats
    print(json.dumps({"steps": a.steps, "repeats": a.repeats, "per_step_s_without": round(wo, 4),
                      "per_step_s_with": round(w, 4), "overhead_per_step_ms": round((w - wo) * 1000, 2),
                      "overhead_pct": round(100 * (w - wo) / wo, 1), "run_bytes": size, "token_steps": calls,
                      "process_cpu_s_per_step_without": round(statistics.median(cpu["without"]), 4),
                      "process_cpu_s_per_step_with": round(statistics.median(cpu["with"]), 4),
                      "training_thread_cpu_ms_per_step": {k: round(1000 * v / n_steps, 3) for k, v in spent.items()},
                      "all_with": [round(x, 4) for x in times["with"]],
                      "all_without": [round(x, 4) for x in times["without"]]}))
    if a.write_doc:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
        from doc_block import header, shown_command, write_block

        script = "tests/integration/bench_trl.py"
        cw, cwo = statistics.median(cpu["with"]), statistics.median(cpu["without"])
        thread = {k: 1000 * v / n_steps for k, v in spent.items()}
        table = ["| | per optimizer step |", "|---|---|",
                 f"| training thread inside grpolens (loss calls + generation records) | **{sum(thread.values()):.1f} ms** "
                 f"CPU ({thread['loss_call']:.1f} + {thread['generation']:.1f}) |",
                 f"| whole process CPU, with vs without | {cw:.3f} s vs {cwo:.3f} s ({100 * (cw - cwo) / cwo:+.1f} %, "
                 "writer thread included) |",
                 f"| wall time, with vs without | {w:.2f} s vs {wo:.2f} s |",
                 f"| disk | {size / 1e3:.0f} kB for {a.steps} steps with text (Parquet, zstd) |"]
        write_block("docs/integrations/trl.md", "bench_trl", script,
                    header(shown_command(script, sys.argv[1:]), started) + "\n\n" + shape + "\n\n" + "\n".join(table))
        print("docs/integrations/trl.md updated")


if __name__ == "__main__":
    main()
