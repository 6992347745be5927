"""`train-ledger buffer`: the 2-rank buffer / distributed-optimizer toy (docs/buffer_layout.md, "The toy"), on the
engine's real classes."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from cli.args import CommandParser
from cli.progress import Progress, progress_wanted
from cli.train import launcher_parser, torchrun_command


def _span(elements: dict[str, list[int]]) -> str:
    return " ".join(f"{name}[{lo}:{hi}]" for name, (lo, hi) in elements.items())


def format_report(r: dict[str, Any]) -> str:
    ranges = ", ".join(f"{name}: [{lo}, {hi})" for name, (lo, hi) in r["ranges"].items())
    wl_lo, wl_hi = r["ranges"]["WL"]
    b = r["boundary"]
    rest = f"element {b}" if wl_hi - b == 1 else f"elements {b}..{wl_hi - 1}"
    lines = [f"layout rule: {r['rule']} (Megatron's default alignment would give numel="
             f"{r['megatron_aligned']['numel']} pad={r['megatron_aligned']['pad']})",
             f"numel={r['numel']} pad={r['pad']}",
             f"{ranges}; views share param_data: {r['views_share_param_data']}",
             f"shard boundary={b}: WL elements {wl_lo}..{b - 1} on rank0, {rest} on rank1"]
    for rank, owned in r["owned"].items():
        lo, hi = owned["range"]
        lines.append(f"{rank} owns buffer [{lo}, {hi}): {_span(owned['elements'])}")
    for step, ranks in enumerate(r["steps"], 1):
        lines.append(f"step {step}: 2 micro-batches of dW accumulated into main_grad -> reduce-scatter -> "
                     f"Adam on the shards -> all-gather")
        for s in ranks:
            lo, hi = r["owned"][f"rank{s['rank']}"]["range"]
            lines.append(f"  rank{s['rank']} got grad_data[{lo}:{hi}] (sum={s['grad_shard_sum']:.4f}); Adam updated "
                         f"{s['adam_elements']} fp32 master elements; after all-gather param_data "
                         f"sum={s['param_data_sum']:.4f}")
    per_param = ", ".join(f"{name} {d:.1e}" for name, d in r["max_abs_diff_per_param"].items())
    lines += [f"max |parallel - single-process| after {len(r['steps'])} steps: {r['max_abs_diff']:.1e} "
              f"({per_param}; tolerance {r['tolerance']:.0e})",
              f"matches single-process Adam: {r['matches']}"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = CommandParser("buffer", description="the buffer / ZeRO-1 toy: 2 gloo ranks on CPU")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = p.parse_args(argv)
    result = run_toy(Progress("buffer", progress_wanted(a.json)))
    print(json.dumps(result) if a.json else format_report(result))
    return 0 if result["matches"] else 1


def run_toy(progress: Progress | None = None) -> dict[str, Any]:
    """The toy as a real 2-rank torchrun program (engine.toys.buffer_toy); its summary, or RuntimeError with the
    ranks' output when it fails (a bug, not bad input)."""
    progress = progress or Progress("buffer", False)
    launch = launcher_parser().parse_args(["--nproc-per-node", "2"])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "buffer.json"
        with progress.waiting("2 gloo ranks (torchrun) running the toy's 2 steps and the single-process check"):
            done = subprocess.run(torchrun_command(launch, "engine.toys.buffer_toy", ["--out", str(out)]),
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        progress(f"ranks finished (exit {done.returncode})")
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"the buffer toy failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
        return json.loads(out.read_text(encoding="utf-8"))
