"""Real data against mock data, and a checkpoint's save and resume, on the machine at hand, through the CLI.

    python runs/bench/data_and_checkpoint.py --out DIR [--iters 10] [--model llama3.2-1b] [--seq 4096]

1. A corpus (deterministic pseudo-words, enough tokens for every sample) -> `train-ledger preprocess` (byte-level).
2. Four runs, same flags (bf16, distributed optimizer, micro-batch 1, 8 micro-batches, --timers):
   mock      --mock-data, --iters steps
   real      --data-path, --iters steps
   save      --data-path, --save, --exit-interval iters/2 (saves there and stops)
   resume    --data-path, --load, --iters steps: continues from iters/2
3. Prints tokens/s (median of the steady steps: not the first) of mock and real and their ratio; the save's bytes
   and seconds per rank from its checkpoint events; and whether every loss and grad norm of `resume` equals `real`'s
   for the same step (bit for bit: the floats as logged).
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
    cli("train", *common, "--mock-data", "--train-iters", str(args.iters), "--run-dir", str(out / "mock"))
    cli("train", *common, *data, "--train-iters", str(args.iters), "--run-dir", str(out / "real"))
    cli("train", *common, *data, "--train-iters", str(args.iters), "--save", str(out / "ckpt"),
        "--exit-interval", str(half), "--run-dir", str(out / "save"))
    cli("train", *common, *data, "--train-iters", str(args.iters), "--load", str(out / "ckpt"),
        "--run-dir", str(out / "resume"))

    def tokens_per_s(run: str) -> float:
        return statistics.median(s["tokens_per_s"] for s in events(out / run, "step") if s["step"] > 1)

    mock, real = tokens_per_s("mock"), tokens_per_s("real")
    saves = [e for e in events(out / "save", "checkpoint") if e.get("action") == "save"]
    straight = {s["step"]: (s["loss"], s["grad_norm"]) for s in events(out / "real", "step")}
    resumed = {s["step"]: (s["loss"], s["grad_norm"]) for s in events(out / "resume", "step")}
    same = all(straight[k] == v for k, v in resumed.items())
    result = {"tokens_per_s": {"mock": mock, "real": real, "real_over_mock": real / mock},
              "saves": saves, "resumed_steps": sorted(resumed), "bit_exact": same,
              "losses": {"straight": straight, "resumed": resumed}}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(f"tokens/s mock {mock:,.0f} real {real:,.0f} real/mock {real / mock:.4f}")
    for s in saves:
        print(f"save at iteration {s['iteration']}: {s['bytes']:,} bytes in {s['seconds']:.2f} s")
    print(f"resumed steps {sorted(resumed)}: losses and grad norms equal to the straight run: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
