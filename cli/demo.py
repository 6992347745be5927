"""`train-ledger demo`: the main job on whatever machine this is: an instrumented run -> reconcile -> report.

Without a GPU it runs the reference run's layout (docs/engine.md, "The reference run") on 8 gloo ranks: TP2 x PP2 x
DP2 with sequence parallelism, the distributed optimizer and both overlaps, micro-batch 1 and global batch 16, so each
pipeline runs 8 micro-batches a step and the analytic bubble is (p-1)/(m+p-1) = 1/9; the model is `tiny`. With GPUs
it runs the same flags with --bf16 on the GPUs present, the layout cut to fit (8: the reference run's; 4: PP2 x DP2,
which keeps the pipeline and its bubble; 2: DP2; 1: one GPU; other counts use the largest of these that fits) and
llama3.2-1b's shape cut to 4 layers at sequence 4096 (0.51 B parameters: its vocabulary matrix is full size, which
keeps the memory rows' proportions real while one GPU holds it). 8 micro-batches per pipeline per step in every
layout. The embedding and output layer are tied, Megatron's default and the real Llama-3.2-1B's (the reference run
unties them): under PP2 the last stage holds a copy and the two ends all-reduce its gradient each step, a row of its
own.

On the CPU the DDP bucket size is CPU_BUCKET_SIZE elements, so that the first stage's layers fill four buckets
beside the embedding's own: overlap then has buckets to show, each (but the last issued) with its predicted overlap.
Later pipeline stages keep one bucket for their layers, as Megatron does (their reduction is off the critical path).
Memory is measured on the CPU too, by the probes' census of the tensors the model and optimizer hold at each
lifecycle point (probes.memory.tensor_census). When the ranks outnumber the machine's cores, timings are dominated by
waiting for a core: the demo says so once, up front, and the ledger shows the timing rows without judging them
(ledger.reconcile.oversubscribed), stating the reason once among the run's notes.

Every probe is on (--all-probes) and the profiler window covers steps 2-3 on every rank; torch.profiler records one
step more (4) and every rank waits for the slowest trace export in the step after (5), so the default 6 steps leave
step 6 steady on every device: the step time is measured outside the profiler (ledger/evidence/steps.py). The phases,
each announced on a line: training under torchrun (the engine logs each step), reconciliation and report (in this
process, through ledger.reconcile.run and ledger.present.report), the headline rows, and the command that opens the
run in the dashboard.
"""
from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from cli.args import CommandParser
from common.errors import ConfigError
from dashboard.launch import DEFAULT_ROOT

MICROBATCHES = 8  # per pipeline per step: the reference run's global batch 16 over DP2 at micro-batch 1
# Elements. The tiny model's layer holds ~23k parameter elements per TP rank and a bucket closes once it holds this
# many, so the first stage's two layers fill four buckets (16,896 + 11,904 + 11,264 + 6,272 elements) and the
# embedding its own; Megatron's default (40 M) puts a whole tiny stage in one bucket, with nothing to overlap.
CPU_BUCKET_SIZE = 10_000
MAX_DEMO_ITERS = 1000
PROFILE_STEPS = (2, 3)  # the profiler window; step 1 carries one-time work and the ledger leaves it out
# The window, torch.profiler's extra step and the step after the trace export, then one steady step.
MIN_DEMO_ITERS = PROFILE_STEPS[1] + 3


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int
    pp: int
    gpu: bool

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    def describe(self) -> str:
        """The layout and what of the reference run's configuration is active in it (SP needs TP > 1, the overlaps
        DP > 1)."""
        where = f"{self.world} GPU{'s' if self.world > 1 else ''}" if self.gpu else f"{self.world} gloo ranks (no GPU)"
        active = (["sequence parallel"] if self.tp > 1 else []) + ["distributed optimizer"]
        if self.dp > 1:
            active.append("overlapped grad reduce-scatter and param all-gather")
        return f"{where}: TP{self.tp} x PP{self.pp} x DP{self.dp}, {', '.join(active)}"


# GPUs -> (TP, PP); the rest of the world is DP.
GPU_LAYOUTS = {8: (2, 2), 4: (1, 2), 2: (1, 1), 1: (1, 1)}


def choose_layout(gpus: int) -> Layout:
    """The reference run's 8-rank layout on the CPU; on GPUs the largest layout of GPU_LAYOUTS that fits."""
    if gpus == 0:
        return Layout(world=8, tp=2, pp=2, gpu=False)
    world = max(n for n in GPU_LAYOUTS if n <= gpus)
    tp, pp = GPU_LAYOUTS[world]
    return Layout(world=world, tp=tp, pp=pp, gpu=True)


def model_flags(layout: Layout) -> list[str]:
    if layout.gpu:
        return ["--model", "llama3.2-1b", "--num-layers", "4", "--bf16", "--lr", "3e-4", "--min-lr", "3e-5"]
    return ["--model", "tiny", "--lr", "3e-3", "--min-lr", "3e-4", "--ddp-bucket-size", str(CPU_BUCKET_SIZE)]


def demo_flags(layout: Layout, train_iters: int, run_dir: Path) -> list[str]:
    """The engine's flags: Megatron's names, as runs/engine/llama1b_tp2pp2dp2.sh passes them (tied: no --untie-...)."""
    start, end = PROFILE_STEPS
    return [*model_flags(layout),
            "--tensor-model-parallel-size", str(layout.tp), "--pipeline-model-parallel-size", str(layout.pp),
            "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
            "--micro-batch-size", "1", "--global-batch-size", str(MICROBATCHES * layout.dp),
            "--train-iters", str(train_iters), "--mock-data", "--all-probes",
            "--use-pytorch-profiler", "--profile-step-start", str(start), "--profile-step-end", str(end),
            "--profile-ranks", *map(str, range(layout.world)), "--run-dir", str(run_dir)]


def phase(text: str) -> None:
    print(f"demo: {text}", flush=True)


# --- headline rows ----------------------------------------------------------------------------------------------
def analytic_bubble(rows: list[dict]) -> str:
    """The bubble rows' prediction as a fraction: the formula's (p-1)/(v m+p-1) for the run's p, m and v."""
    from ledger.present.units import DASH, percent

    predicted = {r["predicted"] for r in rows if r["predicted"] is not None}
    return ", ".join(f"{percent(p)} ({Fraction(p).limit_denominator(10_000)})" for p in sorted(predicted)) or DASH


def headline_line(label: str, rows: list[dict]) -> str:
    from ledger.present.headline import verdict
    from ledger.present.row_groups import TIME_MODEL, predictor
    from ledger.present.units import span
    from ledger.reconcile.oversubscribed import NOT_JUDGED
    from ledger.reconcile.rows import NOT_ON_CPU

    if not rows:
        return f"  {label:<31} no row in this run"
    unit = rows[0]["unit"]
    predicted = analytic_bubble(rows) if rows[0]["metric"].startswith("pipeline.bubble") else \
        span([r["predicted"] for r in rows], unit)
    census = " (CPU tensor census)" if all(r["source"] == "tensor_census" for r in rows) else ""
    by = "model" if predictor(rows[0]["metric"]) == TIME_MODEL else "formula"
    columns = (f"{by} {predicted} | inventory {span([r['inventory'] for r in rows], unit)} | "
               f"measured {span([r['measured'] for r in rows], unit)}{census}")
    ranks = {r["rank"] for r in rows if r["rank"] is not None}
    where = f"over {len(ranks)} rank{'s' if len(ranks) > 1 else ''}" if ranks else rows[0]["scope"]
    line = f"  {label:<31} {columns} [{verdict(rows)}; {where}]"
    if all(r["measured"] is None and r["inventory"] is None for r in rows) and rows[0]["predicted"] is None:
        line += f": {rows[0]['explanation']}"
    elif all(r["measured"] is None for r in rows) and NOT_ON_CPU in rows[0]["explanation"]:
        line += f": {NOT_ON_CPU}"
    elif all(NOT_JUDGED in r["explanation"] for r in rows):
        line += f": {NOT_JUDGED}"
    return line


def print_headline(result) -> None:
    from ledger.present.headline import HEADLINES, rows_of

    counts = ", ".join(f"{n} {kind}" for kind, n in result.verdict_counts().items())
    print(f"headline ({len(result.rows)} rows: {counts}; every row with its explanation in report.md):")
    rows = [r.to_dict() for r in result.rows]
    for headline in HEADLINES:
        print(headline_line(headline.label, rows_of(rows, headline)))
    for line in result.missing:
        print(f"  missing: {line}")


# --- the pipeline -------------------------------------------------------------------------------------------------
def timing_note(layout: Layout, cores: int | None) -> str | None:
    """The one up-front line when the CPU ranks outnumber the cores they run on (the ledger's criterion:
    evidence.cpu_sharing), else None."""
    if layout.gpu or (cores is not None and layout.world <= cores):
        return None
    where = f"this machine's {cores} core{'s' if cores != 1 else ''}" if cores else "this machine's cores"
    return (f"timings: {layout.world} ranks share {where}, so every timed range holds waits for a core: time, "
            "pipeline, overlap and throughput rows are measured and shown but not judged (n/a); memory, "
            "communication volume and rank groups are judged")


def train_phase(layout: Layout, train_iters: int, run_dir: Path) -> int:
    from cli import train
    from probes.manifest import usable_cores

    model = "llama3.2-1b cut to 4 layers, bf16" if layout.gpu else "tiny"
    phase(f"[1/3] training {model} on {layout.describe()}; {MICROBATCHES} micro-batches of 1 per pipeline per step, "
          f"{train_iters} steps, every probe on; {profiled_steps(train_iters)} -> {run_dir}")
    note = timing_note(layout, usable_cores())
    if note:
        phase(f"      {note}")
    return train.main(["--nproc-per-node", str(layout.world), *demo_flags(layout, train_iters, run_dir)],
                      say_next=False)


def profiled_steps(train_iters: int) -> str:
    """The profiler window and what it records, in words: torch.profiler records one step past the window, which
    HTA drops (probes/profiler.py), and the ledger leaves every profiled step out of steady-state figures."""
    start, end = PROFILE_STEPS
    text = f"the profiler window is steps {start}-{end} on every rank"
    if train_iters > end:
        text += f" (it records step {end + 1} too, which HTA drops: steps {start}-{end + 1} are profiled)"
    return text


def ledger_phases(run_dir: Path):
    from ledger.present import report
    from ledger.reconcile.run import reconcile, write

    phase("[2/3] reconciling formula vs inventory vs measurement")
    result = reconcile(run_dir)
    json_path, csv_path = write(result)
    phase(f"      wrote {json_path} and {csv_path}")
    phase("[3/3] writing the report")
    md, page = report.write(str(run_dir))
    phase(f"      wrote {md} and {page} (the .html opens offline in any browser)")
    return result


def dashboard_command(run_dir: Path) -> str:
    return shlex.join(["train-ledger", "dashboard", "--runs-root", str(run_dir.parent), "--run", run_dir.name])


def checked_run_dir(run_dir: Path) -> Path:
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"--run-dir {run_dir}: not empty; the demo writes a new run directory")
    return run_dir


def parser() -> CommandParser:
    p = CommandParser("demo", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", type=Path, help=f"default: {DEFAULT_ROOT}/demo-<timestamp>")
    p.add_argument("--train-iters", type=int, default=MIN_DEMO_ITERS,
                   help=f"steps (default {MIN_DEMO_ITERS}: the window {PROFILE_STEPS[0]}-{PROFILE_STEPS[1]}, the "
                        "profiler's extra step, the step after the trace export and one steady step)")
    return p


def checked_iters(train_iters: int) -> int:
    if not MIN_DEMO_ITERS <= train_iters <= MAX_DEMO_ITERS:
        raise ConfigError(f"--train-iters {train_iters}: the demo takes {MIN_DEMO_ITERS} (its profiler window, the "
                          f"profiler's extra step, the step after the trace export and one steady step) to "
                          f"{MAX_DEMO_ITERS} steps; `train-ledger train` runs longer")
    return train_iters


def main(argv: list[str]) -> int:
    import torch

    a = parser().parse_args(argv)
    checked_iters(a.train_iters)
    run_dir = checked_run_dir(a.run_dir or DEFAULT_ROOT / f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    layout = choose_layout(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    status = train_phase(layout, a.train_iters, run_dir)
    if status != 0:
        phase(f"training failed (exit status {status}); what the ranks wrote is in {run_dir}")
        return status
    result = ledger_phases(run_dir)
    print_headline(result)
    print(f"open it in the dashboard:\n  {dashboard_command(run_dir)}", flush=True)
    return 0
