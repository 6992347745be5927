"""Real data against mock data, an asynchronous checkpoint save, and a deterministic resume, on the machine at hand,
through the CLI.

    python runs/bench/data_and_checkpoint.py --out DIR [--iters 10] [--model llama3.2-1b] [--seq 4096]

1. A corpus (deterministic pseudo-words, enough tokens for every sample) -> `train-ledger preprocess` (byte-level).
2. Runs, same flags (bf16, distributed optimizer, micro-batch 1, 8 micro-batches, --timers):
   mock, real, mock, real   --mock-data / --data-path alternated, --iters steps each (side by side: a drift of
                            the machine between runs shows as a difference between the two pairs)
   det, det                 --data-path --deterministic-mode, twice: are two straight runs bit-identical?
   save                     the same with --save --async-save --exit-interval iters/2 (saves there and stops)
   resume                   the same with --load: continues from iters/2
3. Prints tokens/s (median of the steady steps: not the first) of mock and real, per pair and overall, and their
   ratio; the data-wait row of a real run's reconciliation; the save's bytes, blocking and background seconds per
   rank; whether the two deterministic runs agree, and whether `resume` equals them, bit for bit (losses and grad
   norms as logged).
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORDS = [f"w{i}" for i in range(5000)]


def corpus(path: Path, tokens: int) -> None:
    rng = random.Random(0)
    written = 0
    with open(path, "w") as f:
        while written < tokens:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 2000)))
            f.write(json.dumps({"text": text}) + "\n")
            written += len(text.encode()) + 1


def cli(*argv: str) -> None:
    cmd = [sys.executable, "-m", "cli", *argv]
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def events(run: Path, kind: str) -> list[dict]:
    return [e for line in (run / "ranks/rank0/events.jsonl").open() if (e := json.loads(line))["kind"] == kind]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--model", default="llama3.2-1b")
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    gbs = 8
    corpus(out / "corpus.jsonl", 2 * args.iters * gbs * (args.seq + 1))
    (out / "data").mkdir(exist_ok=True)
    cli("preprocess", "--input", str(out / "corpus.jsonl"), "--json-key", "text", "--output-prefix",
        str(out / "data" / "corpus"))
    common = ["--nproc-per-node", "1", "--model", args.model, "--seq-length", str(args.seq),
              "--max-position-embeddings", str(args.seq), "--bf16",
              "--use-distributed-optimizer", "--micro-batch-size", "1", "--global-batch-size", str(gbs),
              "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "1", "--timers"]
    data = ["--data-path", str(out / "data" / "corpus"), "--split", "100,0,0"]
    half = args.iters // 2
    for i in (1, 2):
        cli("train", *common, "--mock-data", "--train-iters", str(args.iters), "--run-dir", str(out / f"mock{i}"))
        cli("train", *common, *data, "--train-iters", str(args.iters), "--run-dir", str(out / f"real{i}"))
    det = [*common, *data, "--deterministic-mode", "--train-iters", str(args.iters)]
    for i in (1, 2):
        cli("train", *det, "--run-dir", str(out / f"det{i}"))
    cli("train", *det, "--save", str(out / "ckpt"), "--async-save", "--exit-interval", str(half),
        "--run-dir", str(out / "save"))
    cli("train", *det, "--load", str(out / "ckpt"), "--run-dir", str(out / "resume"))
    cli("reconcile", str(out / "real1"), "--out", str(out / "real1-ledger"))

    def tokens_per_s(run: str) -> float:
        return statistics.median(s["tokens_per_s"] for s in events(out / run, "step") if s["step"] > 1)

    def losses(run: str) -> dict[int, tuple[float, float]]:
        return {s["step"]: (s["loss"], s["grad_norm"]) for s in events(out / run, "step")}

    pairs = [(tokens_per_s(f"mock{i}"), tokens_per_s(f"real{i}")) for i in (1, 2)]
    mock, real = statistics.mean(m for m, _ in pairs), statistics.mean(r for _, r in pairs)
    saves = [e for e in events(out / "save", "checkpoint") if e.get("action") == "save"]
    rows = json.loads((out / "real1-ledger" / "reconciliation.json").read_text())["rows"]
    wait = [r for r in rows if r["metric"].startswith("time.data_wait")]
    det1, det2, resumed = losses("det1"), losses("det2"), losses("resume")
    deterministic = det1 == det2
    exact = all(det1[k] == v for k, v in resumed.items())
    result = {"tokens_per_s": {"pairs": pairs, "mock": mock, "real": real, "real_over_mock": real / mock},
              "data_wait_rows": wait, "saves": saves, "two_straight_runs_identical": deterministic,
              "resumed_steps": sorted(resumed), "resume_bit_exact": exact,
              "losses": {"det1": det1, "det2": det2, "resumed": resumed}}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    for i, (m, r) in enumerate(pairs, 1):
        print(f"pair {i}: tokens/s mock {m:,.0f} real {r:,.0f} real/mock {r / m:.4f}")
    print(f"tokens/s mock {mock:,.0f} real {real:,.0f} real/mock {real / mock:.4f} (mean of the pairs)")
    for r in wait:
        print(f"{r['metric']} rank {r.get('rank')}: predicted {r.get('predicted')} measured {r.get('measured')} "
              f"{r['verdict']}")
    for s in saves:
        print(f"save at iteration {s['iteration']}: {s['bytes']:,} bytes, blocking {s.get('blocking_seconds')} s, "
              f"background {s.get('background_seconds')} s")
    print(f"two straight --deterministic-mode runs identical: {deterministic}")
    print(f"resumed steps {sorted(resumed)}: losses and grad norms equal to the straight runs: {exact}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
