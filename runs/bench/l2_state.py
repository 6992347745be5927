"""Does the compute sweep time small kernels faster than a step runs them because their inputs sit in L2?

    python3 runs/bench/l2_state.py --out OUT.json.gz [--shapes NAME ...]        # on the GPU
    python3 runs/bench/l2_state.py --judge OUT.json.gz RUN_DIR=NAME ...        # anywhere: the runs' steps from each

The sweep (probes/compute_sweep) times each op again and again on the same tensors: where an op's working set fits
the GPU's L2 (50 MB on an H200) every timed call after the first finds it there, while in a training step most of an
op's inputs (weights, the saved activations a backward reads) were last touched long before. This times every op
of a run's plan twice, as the sweep does (hot) and with the L2 evicted before each timed call (cold: 256 MB written
first), and writes both record sets; a run's step predicted from either (Calibration.from_records) is set against
its measured step on the CPU. The shapes: two launch-bound ones (kernels of a few MB) and a GPU-bound control whose
tensors are far larger than L2.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cli.calibrate import sweep_records  # noqa: E402
from common.arguments import parse_args  # noqa: E402
from common.events import event  # noqa: E402
from ledger.evidence.read import read_run  # noqa: E402
from ledger.reconcile.run import reconcile_evidence  # noqa: E402
from ledger.reconcile.time_rows import predict_run  # noqa: E402
from probes import compute_sweep  # noqa: E402

SMALL = ["--model", "llama3.2-1b", "--num-query-groups", "4", "--hidden-size", "1024", "--ffn-hidden-size", "4096",
         "--num-attention-heads", "16"]
SHAPES = {  # the committed runs these shapes are (tests/fixtures)
    "lb_h1024_l4_s512": SMALL + ["--num-layers", "4", "--seq-length", "512", "--max-position-embeddings", "512",
                                 "--micro-batch-size", "2", "--global-batch-size", "8"],
    "lb_h512_l12_s256": ["--model", "llama3.2-1b", "--num-layers", "12", "--hidden-size", "512", "--ffn-hidden-size",
                         "2048", "--num-attention-heads", "8", "--num-query-groups", "8", "--seq-length", "256",
                         "--max-position-embeddings", "256", "--micro-batch-size", "4", "--global-batch-size", "16"],
    "llama1b_s4096": ["--model", "llama3.2-1b", "--seq-length", "4096", "--micro-batch-size", "1",
                      "--global-batch-size", "8"],
}
EVICT_BYTES = 256 << 20


def timed(cfg, device: torch.device, evict: torch.Tensor | None) -> list[dict]:
    """The run's sweep records as `train-ledger calibrate` times them, with `evict` overwritten before each timed
    call."""
    return sweep_records(cfg, device, use_cache=False, before=None if evict is None else evict.zero_)[0]


def step_with(run: Path, records: list[dict]) -> float:
    """The run's predicted step with `records` in place of its own sweep's records of the same ops at the same dims
    (its records of other ops, or of an op at other dims, kept)."""
    ev = read_run(run)
    key = lambda op, dims: (op, tuple(sorted(dims.items())))  # noqa: E731
    timed = {key(r["op"], r["dims"]): r for r in records}
    for rank in ev.ranks.values():
        rank.compute = [event("compute", None, **timed[key(r.op, r.dims)]) if key(r.op, r.dims) in timed else r
                        for r in rank.compute]
    return predict_run(ev).step.step_time


def judge(path: str, runs: list[str]) -> int:
    """Each RUN_DIR=NAME: its measured step against the step predicted from its own sweep, the hot and the cold.
    Every argument is checked before any run is read: a bad one is one line and exit 2."""
    try:
        with gzip.open(path, "rt") as f:
            found = json.load(f)["shapes"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"l2_state.py: {path}: not an l2_state.py output ({exc.__class__.__name__}: {exc})", file=sys.stderr)
        return 2
    pairs = [spec.partition("=")[::2] for spec in runs]
    bad = [spec for spec, (run, name) in zip(runs, pairs) if name not in found
           or not Path(run, "manifest.json").is_file()]
    if bad or not runs:
        print(f"l2_state.py: {bad[0] if bad else 'no run'}: want RUN_DIR=NAME, a run directory and one of "
              f"{', '.join(found)}", file=sys.stderr)
        return 2
    for run, name in pairs:
        model = predict_run(read_run(run))
        measured = next((r.measured for r in reconcile_evidence(read_run(run)).rows
                         if r.metric == "throughput.step_time"), None)
        if model.step is None or not measured:
            print(f"l2_state.py: {run}: no steady step measured or no step predicted from its own sweep",
                  file=sys.stderr)
            return 2
        own = model.step.step_time
        line = [f"{run}: measured {measured * 1e3:.2f} ms; predicted from its own sweep {own * 1e3:.2f} ms "
                f"({(own / measured - 1) * 100:+.1f}%)"]
        for state in ("hot", "cold"):
            t = step_with(Path(run), found[name][state])
            line.append(f"{state} {t * 1e3:.2f} ms ({(t / measured - 1) * 100:+.1f}%)")
        print(", ".join(line))
    print(f"command: python3 runs/bench/l2_state.py --judge {path} {' '.join(runs)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--out")
    which.add_argument("--judge", metavar="OUT.json.gz")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("runs", nargs="*", metavar="RUN_DIR=NAME")
    args = ap.parse_args(argv)
    if args.judge:
        return judge(args.judge, args.runs)
    if not Path(args.out).resolve().parent.is_dir():
        print(f"l2_state.py: {args.out}: its folder does not exist (nothing timed)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    evict = torch.empty(EVICT_BYTES, dtype=torch.uint8, device=device)
    out = {"device": compute_sweep.device_name(device), "torch": torch.__version__, "shapes": {}}
    for name in args.shapes:
        cfg = parse_args(["--bf16", "--use-distributed-optimizer", *SHAPES[name]], world_size=1)
        t0 = time.perf_counter()
        hot, cold = timed(cfg, device, None), timed(cfg, device, evict)
        out["shapes"][name] = {"flags": SHAPES[name], "hot": hot, "cold": cold}
        total = {k: sum(r["seconds"] for r in rs) * 1e3 for k, rs in (("hot", hot), ("cold", cold))}
        print(f"{name} ({time.perf_counter() - t0:.0f} s): sum of op seconds hot {total['hot']:.3f} ms, "
              f"cold {total['cold']:.3f} ms")
        for h, c in sorted(zip(hot, cold), key=lambda hc: hc[0]["seconds"] - hc[1]["seconds"])[:12]:
            print(f"  {h['op']:36s} hot {h['seconds'] * 1e6:9.1f} us  cold {c['seconds'] * 1e6:9.1f} us  "
                  f"x{c['seconds'] / h['seconds']:.2f}")
    with gzip.open(args.out, "wt") as f:
        json.dump(out, f)
    print(f"command: python3 runs/bench/l2_state.py --out {args.out} --shapes {' '.join(args.shapes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
