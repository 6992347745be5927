"""One rank of the engine with the host's other Python work taken away, to see what it costs a launch-bound step.

    python3 -m torch.distributed.run --standalone --nproc-per-node 1 runs/bench/host_contention.py \
        --variant prefetch-all,gc-off -- <engine.train flags>

Variants (comma-separated; `default` changes nothing):
  prefetch-all  the data loader's thread builds every micro-batch of the run before the first step (its queue as
                deep as the run), so it never wakes, takes the interpreter lock or pins memory during a step
  gc-off        Python's cyclic garbage collector frozen and disabled for the run (Megatron's --manual-gc without
                the periodic collection)
  pass-conditions  beside the start-up pass timings, the same forward and backward issue timed after the host has
                slept (1, 5, 20 ms: a core left idle, as in the step end's waits for the device), after it has spun
                for 5 ms, and after it has read 64 / 512 MiB (its caches evicted): one "PASS_CONDITIONS {json}" line
The run directory is the engine's own; `train-ledger reconcile` judges it like any other. Used by
runs/bench/host_contention_h200.sh; the step's forward and backward ranges beside the start-up pass timings say
whether the training loop's host work is slower than the same passes alone, and why.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VARIANTS = ("default", "prefetch-all", "gc-off", "pass-conditions")
CONDITIONS_REPEATS = 7


def flag(argv: list[str], name: str, default: int) -> int:
    return int(argv[argv.index(name) + 1]) if name in argv else default


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="default")
    ap.add_argument("engine_argv", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    chosen = set(a.variant.split(","))
    if chosen - set(VARIANTS):
        ap.error(f"--variant: unknown {sorted(chosen - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    argv = [x for x in a.engine_argv if x != "--"]
    if "prefetch-all" in chosen:
        import engine.data

        iters, gbs, mbs = (flag(argv, f, d) for f, d in (("--train-iters", 1), ("--global-batch-size", 1),
                                                          ("--micro-batch-size", 1)))
        engine.data.PREFETCH_MIN = iters * (gbs // mbs)  # one rank, no DP: every position of the run
    if "gc-off" in chosen:
        gc.freeze()
        gc.disable()
    if "pass-conditions" in chosen:
        import engine.training

        engine.training.pass_timer = with_conditions(engine.training.pass_timer)
    from engine.train import main as train

    return train(argv)


def conditions() -> dict[str, Callable[[], None]]:
    import numpy as np

    def sleep(ms: float) -> Callable[[], None]:
        return lambda: time.sleep(ms / 1e3)

    def spin() -> None:
        end = time.perf_counter() + 5e-3
        while time.perf_counter() < end:
            pass

    def read(mib: int) -> Callable[[], None]:
        buffer = np.ones(mib * 2**20 // 8)
        return lambda: float(buffer.sum())

    return {"none": lambda: None, "sleep 1 ms": sleep(1), "sleep 5 ms": sleep(5), "sleep 20 ms": sleep(20),
            "spin 5 ms": spin, "read 64 MiB": read(64), "read 512 MiB": read(512)}


def timed_passes(chunk: Any, tokens: Any, before: Callable[[], None]) -> tuple[float, float]:
    """Medians of the forward's and the backward's issue (as engine.probe_adapters.pass_timer times them), each
    after the device drained and then `before` ran on the host."""
    import torch

    forward, backward = [], []
    with chunk.no_sync():
        for i in range(1 + CONDITIONS_REPEATS):
            torch.cuda.synchronize()
            before()
            start = time.perf_counter()
            loss = chunk(tokens, tokens)
            issued = time.perf_counter()
            torch.cuda.synchronize()
            before()
            begin = time.perf_counter()
            torch.autograd.backward(loss, torch.ones_like(loss))
            done = time.perf_counter()
            if i:
                forward.append(issued - start)
                backward.append(done - begin)
    torch.cuda.synchronize()
    chunk.zero_grad_buffer()
    return statistics.median(forward), statistics.median(backward)


def with_conditions(pass_timer: Callable) -> Callable:
    def timer(model, run_config, parallel_state, device):
        measure = pass_timer(model, run_config, parallel_state, device)
        if measure is None:
            return None

        def measured() -> dict[str, float]:
            import torch

            result = measure()
            t, m = run_config.train, run_config.model
            tokens = torch.arange(t.micro_batch_size * m.seq_length, device=device).remainder(m.vocab_size)
            tokens = tokens.view(t.micro_batch_size, m.seq_length)
            found = {name: timed_passes(model[0], tokens, before) for name, before in conditions().items()}
            print("PASS_CONDITIONS " + json.dumps({name: {"forward_ms": f * 1e3, "backward_ms": b * 1e3}
                                                   for name, (f, b) in found.items()}), flush=True)
            return result
        return measured
    return timer


if __name__ == "__main__":
    sys.exit(main())
