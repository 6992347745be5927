"""Do the steps after a profiler window issue slower because CUPTI stays attached? One GPU.

Kineto detaches CUPTI when a profiler stops only under TEARDOWN_CUPTI=1; probes/profiler.py sets it before the
window's stop (where the CUDA version allows), so the steps after the window do not pay CUPTI's callbacks.
Runs of one shape (`demo`: `train-ledger demo`'s one-GPU flags, llama3.2-1b cut to 4 layers; `launch-bound`: the
host sets the step's pace), every probe on, each reconciled: `attached` (TEARDOWN_CUPTI=0, the behaviour before),
`detached` (the default: detached at the window's stop), `no window` (no profiler at all, so no CUPTI either: the
baseline), interleaved over --repeats rounds (the host's pace moves from run to run), and once `detached, graphed`
(--cuda-graph-impl local: CUPTI detached with CUDA graphs captured). Prints per run the host rows the time model is
judged on, the step times after the window, the host sweep's plain and profiled figures, and the command.

    python3 runs/bench/cupti_teardown.py [--shape demo|launch-bound] [--train-iters 12] [--repeats 2] [--out DIR]
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

from cli.demo import MIN_DEMO_ITERS, PROFILE_STEPS, Layout, demo_flags  # noqa: E402
from common.events import HostRecord, StepRecord  # noqa: E402
from common.run_dir import iter_events  # noqa: E402

ROWS = ("time.host_forward_per_microbatch", "time.host_backward_per_microbatch", "throughput.step_time",
        "step.decomposition.host_bound_idle")
WINDOW = ["--use-pytorch-profiler", "--profile-step-start", str(PROFILE_STEPS[0]), "--profile-step-end",
          str(PROFILE_STEPS[1]), "--profile-ranks", "0"]
# tests/fixtures/h200_host_ranges/lb_h1024_l4_s512's shape: the host sets the step's pace
LAUNCH_BOUND = ["--model", "llama3.2-1b", "--num-layers", "4", "--hidden-size", "1024", "--ffn-hidden-size", "4096",
                "--num-attention-heads", "16", "--num-query-groups", "4", "--seq-length", "512",
                "--max-position-embeddings", "512", "--micro-batch-size", "2", "--global-batch-size", "8", "--bf16",
                "--use-distributed-optimizer", "--lr", "3e-4", "--min-lr", "3e-5", "--mock-data", "--all-probes"]
# name -> (environment, profiler window, flags added, flags dropped); graphs take no --overlap-param-gather
VARIANTS = {"attached": ({"TEARDOWN_CUPTI": "0"}, True, [], []), "detached": ({}, True, [], []),
            "no window": ({}, False, [], []),
            "detached, graphed": ({}, True, ["--cuda-graph-impl", "local"], ["--overlap-param-gather"])}


def shape_flags(shape: str, iters: int, run_dir: Path) -> list[str]:
    """The run's flags with no profiler window: the demo's one-GPU run, or the launch-bound shape."""
    if shape == "demo":
        flags = demo_flags(Layout(world=1, tp=1, pp=1, gpu=True), iters, run_dir)
        cut = flags.index("--use-pytorch-profiler")
        return flags[:cut] + flags[flags.index("--run-dir"):]
    return [*LAUNCH_BOUND, "--train-iters", str(iters), "--run-dir", str(run_dir)]


def run_variant(name: str, variant: tuple, shape: str, iters: int, out: Path) -> dict:
    env_extra, window, added, dropped = variant
    run_dir = out / "".join(c if c.isalnum() else "_" for c in f"{shape} {name}")
    flags = [f for f in shape_flags(shape, iters, run_dir) if f not in dropped] + (WINDOW if window else []) + added
    env = {k: v for k, v in os.environ.items() if k != "TEARDOWN_CUPTI"} | env_extra
    train = [sys.executable, "-m", "cli", "train", "--nproc-per-node", "1", *flags]
    subprocess.run(train, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rec = subprocess.run([sys.executable, "-m", "cli", "reconcile", str(run_dir), "--json"], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    rows = [r for r in json.loads(rec.stdout)["rows"] if r["metric"] in ROWS]
    events = list(iter_events(run_dir, 0, {StepRecord.KIND, HostRecord.KIND}))
    steps = {e.step: e for e in events if isinstance(e, StepRecord)}
    host = {e.op: e for e in events if isinstance(e, HostRecord)}
    return {"command": " ".join(f"{k}={v}" for k, v in env_extra.items()) + " " + shlex.join(train[1:]),
            "rows": rows, "steps": steps, "host": host}


def show(name: str, r: dict) -> None:
    print(f"\n== {name}: {r['command']}")
    for row in r["rows"]:
        step = f" step {row['step']}" if row.get("step") is not None else ""
        print(f"  {row['metric']}{step}: predicted {row['predicted']}, measured {row['measured']} ({row['verdict']})")
    # the first step after the window, torch.profiler's extra step and the trace export (cli/demo.py)
    times = [s.step_time_s for n, s in sorted(r["steps"].items()) if n >= MIN_DEMO_ITERS]
    if times:
        print(f"  steps {MIN_DEMO_ITERS}+: median {1e3 * statistics.median(times):.1f} ms over {len(times)}")
    for op in ("pass.forward", "pass.backward", "launch", "eager", "gemm"):
        if op in r["host"]:
            h = r["host"][op]
            print(f"  host sweep {op}: {1e6 * h.seconds:.1f} us"
                  + (f", under the profiler {1e6 * h.profiled_seconds:.1f} us" if h.profiled_seconds else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-iters", type=int, default=12)
    p.add_argument("--shape", choices=("demo", "launch-bound"), default="demo")
    p.add_argument("--repeats", type=int, default=2, help="rounds of the ungraphed variants, interleaved (the host's "
                   "pace moves from run to run)")
    p.add_argument("--out", type=Path, default=ROOT / "runs/out/cupti_teardown")
    a = p.parse_args()
    if a.train_iters < MIN_DEMO_ITERS or a.repeats < 1:
        p.error(f"--train-iters must be at least {MIN_DEMO_ITERS} (the window and a step after it) and --repeats at "
                "least 1")
    a.out.mkdir(parents=True, exist_ok=True)
    for round_ in range(1, a.repeats + 1):
        for name, variant in VARIANTS.items():
            if variant[2] and round_ > 1:
                continue
            label = f"{name} (round {round_})"
            show(f"{a.shape}, {label}", run_variant(label, variant, a.shape, a.train_iters, a.out))
    print(f"\ncommand: python3 runs/bench/cupti_teardown.py --shape {a.shape} --train-iters {a.train_iters} "
          f"--repeats {a.repeats}")


if __name__ == "__main__":
    main()
