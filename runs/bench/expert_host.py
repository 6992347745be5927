"""The host's time to issue SequentialMLP's experts, unprofiled: mixtral-8x7b's 8 experts (hidden 4096, width 14,336)
as the engine runs them at EP 1 (engine/transformer/moe/experts.py), forward and backward, with the device kept busy
by a sleep kernel so the host never waits on it. Three kinds of row counts: the same every call ("seen"); counts the
process has never met ("new": each call's 8 drawn without replacement from [64, 2048), printed per BIN calls, so the
cost of a new count shows against how many the process has already met); counts met before but not on the last call
("met before": the new calls' counts replayed in another order). Why: SequentialMLP runs miss the time model by
8-28% (BENCHMARKS.md), their device idle before the experts' launches, and a routed micro-batch's counts are rarely
the last one's. Beside the measurement the script prints the host recipes' price of one expert from the host sweep of
the machine it runs on.

    python runs/bench/expert_host.py [--calls 40] [--bin 10]
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.arguments import parse_args  # noqa: E402
from common.config import RunConfig  # noqa: E402
from common.errors import ConfigError  # noqa: E402
from common.events import parse_event  # noqa: E402
from engine.tensor_parallel.mappings import TPGroup  # noqa: E402
from engine.transformer.mlp import swiglu, swiglu_any_rows  # noqa: E402
from engine.transformer.moe.experts import SequentialMLP  # noqa: E402
from ledger.models.time_model import host_recipe  # noqa: E402
from ledger.models.time_model.host_costs import host_costs  # noqa: E402
from ledger.models.time_model.ops import chunk_backward, chunk_forward  # noqa: E402
from probes import host_sweep  # noqa: E402

ROWS = 8192  # a routed micro-batch of seq 4096 at top-2: the seen counts' sum
NEW_COUNTS = range(64, 2048)  # where new counts are drawn from (a routed expert's rows, early in training)
BUSY_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: longer than any forward's issue


def even_counts(experts: int) -> list[int]:
    """ROWS spread evenly over the experts."""
    return [ROWS // experts + (e < ROWS % experts) for e in range(experts)]


def new_counts(rng: random.Random, experts: int, calls: int) -> list[list[int]]:
    """`calls` lists of `experts` counts, no count twice."""
    drawn = rng.sample(NEW_COUNTS, experts * calls)
    return [drawn[i * experts:(i + 1) * experts] for i in range(calls)]


def host_us(call: Callable[[], object], cuda: bool) -> tuple[float, float, object]:
    """(host microseconds to issue `call`, device microseconds it ran, what it returned), the device busy before it
    starts."""
    if cuda:
        torch.cuda._sleep(BUSY_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    out = call()
    host = (time.perf_counter() - t0) * 1e6
    if not cuda:
        return host, host, out
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) * 1e3, out


def step_us(mlp: SequentialMLP, tokens: torch.Tensor, per_expert: list[int], cuda: bool
            ) -> tuple[float, float, float, float]:
    """(forward host, forward device, backward host, backward device) microseconds of one forward and its backward
    on the row counts `per_expert` (the first sum(per_expert) rows of `tokens`)."""
    rows = tokens[:sum(per_expert)]
    f_host, f_dev, out = host_us(lambda: mlp(rows, per_expert), cuda)
    grad = torch.ones_like(out)
    b_host, b_dev, _ = host_us(lambda: out.backward(grad), cuda)
    return f_host, f_dev, b_host, b_dev


def swiglu_host_us(device: torch.device) -> dict[str, float]:
    """Host microseconds a call of the engine's compiled SwiGLU takes on a tiny input under autograd, timed as the
    host sweep times its `compiled` primitive (probes/host_sweep.py seconds_per_call, its CUDA sizes): the dense MLP's
    (static rows) against an expert's (rows marked dynamic), at one row count and at a new count every call."""
    calls, repeats, _, warmup = host_sweep.SIZES["cuda"]

    def per_call(fn: Callable, new_count: bool) -> float:
        inputs = iter([torch.randn(64 + (i if new_count else 0), 16, device=device, requires_grad=True)
                       for i in range(warmup + repeats * calls)])
        return host_sweep.seconds_per_call(lambda: fn(next(inputs)), calls, repeats, warmup,
                                           torch.cuda.synchronize) * 1e6
    return {"static rows": per_call(swiglu, False), "any rows, one count": per_call(swiglu_any_rows, False),
            "any rows, a new count each call": per_call(swiglu_any_rows, True)}


def recipe_us(cfg: RunConfig, device: torch.device) -> dict[str, float]:
    """The host recipes' microseconds for layer 0's first expert, forward and backward, priced by this machine's own
    host sweep (probes/host_sweep.py, run here) in the recipes' context (host_recipe.CONTEXT): what the time model
    would predict for the host on this machine."""
    records = [parse_event({"kind": "host", "step": None, **r}) for r in host_sweep.run(device, profiled=False)]
    costs, _ = host_costs(records)
    if costs is None:
        return {}
    costs = dataclasses.replace(costs, context=host_recipe.CONTEXT)
    expert = "decoder.layers.0.mlp.experts.0."

    def priced(work: list, forward: bool) -> float:
        own = [i for i, w in enumerate(work) if w.param and w.param.startswith(expert)]
        first = own[0] if forward else own[0] - 1  # in backward fc2's dgrad (no parameter) comes before its wgrad
        recipes = [host_recipe.entry(w, forward) for w in work[first:own[-1] + 1]]
        return costs.price(host_recipe.sum_of(*recipes)) * 1e6
    return {"forward": priced(chunk_forward(cfg, 0, 0), True), "backward": priced(chunk_backward(cfg, 0, 0), False)}


def report(name: str, laps: list[tuple[float, float, float, float]], experts: int) -> None:
    """One line a pass: the median host and device microseconds of a call and of an expert, host min and max."""
    for i, pass_ in ((0, "forward"), (2, "backward")):
        host, dev = statistics.median(lap[i] for lap in laps), statistics.median(lap[i + 1] for lap in laps)
        print(f"{name} {pass_}: host {host:.0f} us ({host / experts:.0f} us an expert; min "
              f"{min(lap[i] for lap in laps):.0f}, max {max(lap[i] for lap in laps):.0f}), device {dev:.0f} us "
              f"({dev / experts:.0f} an expert), over {len(laps)} calls")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=40, help="calls of each kind")
    ap.add_argument("--bin", type=int, default=10, help="new-count calls a line")
    ap.add_argument("--model", default="mixtral-8x7b-2l")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.bin < 1:
        print("expert_host.py: --calls and --bin must be at least 1", file=sys.stderr)
        return 2
    try:
        run_cfg = parse_args(["--model", args.model, "--bf16"], world_size=1)
        cfg = run_cfg.model
    except ConfigError as exc:
        print(f"expert_host.py: {exc}", file=sys.stderr)
        return 2
    if not cfg.is_moe:
        print(f"expert_host.py: --model {args.model} has no experts", file=sys.stderr)
        return 2
    experts = cfg.num_experts
    if experts * args.calls > len(NEW_COUNTS):
        print(f"expert_host.py: --calls {args.calls} needs {experts * args.calls} new row counts; "
              f"[{NEW_COUNTS.start}, {NEW_COUNTS.stop}) holds {len(NEW_COUNTS)}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mlp = SequentialMLP(cfg, "decoder.layers.0.mlp", ep_size=1, ep_rank=0, tp=TPGroup(group=None, size=1, rank=0),
                        params_dtype=torch.bfloat16, device=device, seed=1)
    tokens = torch.randn(max(ROWS, experts * NEW_COUNTS.stop), cfg.hidden_size, device=device, dtype=torch.bfloat16,
                         requires_grad=True)
    cuda = device.type == "cuda"
    for param in mlp.parameters():  # the engine's wgrads accumulate into main_grad (gradient-accumulation fusion)
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)
    seen, rng = even_counts(experts), random.Random(0)
    for _ in range(5):  # compile the SwiGLU, meet the seen counts
        step_us(mlp, tokens, seen, cuda)
    report("seen", [step_us(mlp, tokens, seen, cuda) for _ in range(args.calls)], experts)
    fresh = new_counts(rng, experts, args.calls)
    laps = [step_us(mlp, tokens, c, cuda) for c in fresh]
    for first in range(0, args.calls, args.bin):
        report(f"new (calls {first + 1}-{min(first + args.bin, args.calls)}, "
               f"{experts * first} counts met before them)", laps[first:first + args.bin], experts)
    again = rng.sample(fresh, len(fresh))
    if again[0] == fresh[-1]:  # never the counts of the call just before
        again = again[1:] + again[:1]
    report("met before", [step_us(mlp, tokens, c, cuda) for c in again], experts)
    if cuda:
        for pass_, us in recipe_us(run_cfg, device).items():
            print(f"host recipe for an expert's {pass_}, priced by this machine's host sweep: {us:.0f} us")
        for name, us in swiglu_host_us(device).items():
            print(f"compiled SwiGLU on 16 columns, {name}: host {us:.1f} us a call")
    print(f"device: {torch.cuda.get_device_name(device) if cuda else 'cpu'}, torch {torch.__version__}")
    print(f"command: python3 runs/bench/expert_host.py --calls {args.calls} --bin {args.bin} --model {args.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
