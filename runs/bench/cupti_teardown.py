"""Do the steps after a profiler window issue slower because CUPTI stays attached? One GPU, the demo's run.

Kineto detaches CUPTI when a profiler stops only under TEARDOWN_CUPTI=1; probes/profiler.py now sets it (where the
CUDA version allows), so the steps after the host sweep's profiled half and after the window no longer pay CUPTI's
callbacks. Three runs of `train-ledger demo`'s one-GPU flags (llama3.2-1b cut to 4 layers, every probe on), each
reconciled: `attached` (TEARDOWN_CUPTI=0, the behaviour before), `detached` (the default now), `no window` (no
profiler at all, so no CUPTI either: the baseline) and `detached, graphed` (--cuda-graph-impl local: CUPTI detached
and re-attached with CUDA graphs captured). Prints per run the host rows the time model is judged on, the
step times after the window and the host sweep's plain and profiled pass timers, and the command.

    python3 runs/bench/cupti_teardown.py [--train-iters 12] [--repeats 2] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cli.demo import Layout, demo_flags  # noqa: E402

ROWS = ("time.host_forward_per_microbatch", "time.host_backward_per_microbatch", "throughput.step_time",
        "step.decomposition.host_bound_idle")
WINDOW_FLAGS = ("--use-pytorch-profiler", "--profile-step-start", "--profile-step-end", "--profile-ranks")
# name -> (environment, profiler window, extra flags)
VARIANTS = {"attached": ({"TEARDOWN_CUPTI": "0"}, True, []), "detached": ({}, True, []),
            "no window": ({}, False, []), "detached, graphed": ({}, True, ["--cuda-graph-impl", "local"])}


def without_window(flags: list[str]) -> list[str]:
    """The flags less the profiler window's (each flag with its values)."""
    out, skipping = [], False
    for f in flags:
        if f.startswith("--"):
            skipping = f in WINDOW_FLAGS
        if not skipping:
            out.append(f)
    return out


def run_variant(name: str, env_extra: dict[str, str], window: bool, extra: list[str], iters: int,
                out: Path) -> dict:
    run_dir = out / "".join(c if c.isalnum() else "_" for c in name)
    flags = demo_flags(Layout(world=1, tp=1, pp=1, gpu=True), iters, run_dir)
    flags = (flags if window else without_window(flags)) + extra
    env = {k: v for k, v in os.environ.items() if k != "TEARDOWN_CUPTI"} | env_extra
    train = [sys.executable, "-m", "cli", "train", "--nproc-per-node", "1", *flags]
    subprocess.run(train, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rec = subprocess.run([sys.executable, "-m", "cli", "reconcile", str(run_dir), "--json"], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    rows = [r for r in json.loads(rec.stdout)["rows"] if r["metric"] in ROWS]
    events = [json.loads(line) for line in (run_dir / "ranks/rank0/events.jsonl").read_text().splitlines()]
    steps = {e["step"]: e for e in events if e["kind"] == "step"}
    host = {e["op"]: e for e in events if e["kind"] == "host"}
    return {"command": " ".join(f"{k}={v}" for k, v in env_extra.items()) + " " + shlex.join(train[1:]),
            "rows": rows, "steps": steps, "host": host}


def show(name: str, r: dict) -> None:
    print(f"\n== {name}: {r['command']}")
    for row in r["rows"]:
        step = f" step {row['step']}" if row.get("step") is not None else ""
        print(f"  {row['metric']}{step}: predicted {row['predicted']}, measured {row['measured']} ({row['verdict']})")
    late = [s for n, s in sorted(r["steps"].items()) if n is not None and n >= 6]
    times = [s["step_time_s"] for s in late]
    if times:
        print(f"  steps 6+: median {1e3 * statistics.median(times):.1f} ms over {len(times)}")
    for op in ("pass.forward", "pass.backward", "launch", "eager", "gemm"):
        if op in r["host"]:
            h = r["host"][op]
            prof = h.get("profiled_seconds")
            print(f"  host sweep {op}: {1e6 * h['seconds']:.1f} us"
                  + (f", under the profiler {1e6 * prof:.1f} us" if prof else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-iters", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2, help="rounds of the ungraphed variants, interleaved (the host's "
                   "pace moves from run to run)")
    p.add_argument("--out", type=Path, default=ROOT / "runs/out/cupti_teardown")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for round_ in range(1, a.repeats + 1):
        for name, (env_extra, window, extra) in VARIANTS.items():
            if extra and round_ > 1:
                continue
            label = f"{name} (round {round_})"
            show(label, run_variant(label, env_extra, window, extra, a.train_iters, a.out))
    print(f"\ncommand: python3 runs/bench/cupti_teardown.py --train-iters {a.train_iters} --repeats {a.repeats}")


if __name__ == "__main__":
    main()
