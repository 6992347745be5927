"""The host's time to issue SequentialMLP's experts, unprofiled: mixtral-8x7b's 8 experts (hidden 4096, width 14,336)
as the engine runs them at EP 1 (engine/transformer/moe/experts.py), forward and backward, with the device kept busy
by a sleep kernel so the host never waits on it. Row counts the same every call ("seen") against new ones every call
("fresh", 8,192 rows spread +-15% over the experts, as a routed micro-batch of seq 4096 at top-2 is). Why: a 40-step
mixtral-8x7b-2l run's settled forward range took 15.7 ms against 12.9 predicted, its device idle before the experts'
launches, while the host recipes price an expert's forward well under its ~510 us of kernels (BENCHMARKS.md
2026-12-05, fourth entry); the script prints their price from the host sweep of the machine it runs on beside what
it measured there.

    python runs/bench/expert_host.py [--calls 30]
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

ROWS, SPREAD = 8192, 0.15
BUSY_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: longer than any forward's issue


def counts(rng: random.Random, experts: int) -> list[int]:
    """Row counts summing to ROWS, each within +-SPREAD of the mean."""
    mean = ROWS // experts
    out = [mean + rng.randint(-int(SPREAD * mean), int(SPREAD * mean)) for _ in range(experts - 1)]
    return out + [ROWS - sum(out)]


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
    on the row counts `per_expert`."""
    f_host, f_dev, out = host_us(lambda: mlp(tokens, per_expert), cuda)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--model", default="mixtral-8x7b-2l")
    args = ap.parse_args(argv)
    if args.calls < 1:
        print("expert_host.py: --calls must be at least 1", file=sys.stderr)
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
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mlp = SequentialMLP(cfg, "decoder.layers.0.mlp", ep_size=1, ep_rank=0, tp=TPGroup(group=None, size=1, rank=0),
                        params_dtype=torch.bfloat16, device=device, seed=1)
    tokens = torch.randn(ROWS, cfg.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    rng, experts = random.Random(0), cfg.num_experts
    seen = counts(rng, experts)
    cuda = device.type == "cuda"
    for param in mlp.parameters():  # the engine's wgrads accumulate into main_grad (gradient-accumulation fusion)
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)
    for _ in range(5):  # compile the SwiGLU, meet the seen counts
        step_us(mlp, tokens, seen, cuda)
    for name, pick in (("seen", lambda: seen), ("fresh", lambda: counts(rng, experts))):
        laps = [step_us(mlp, tokens, pick(), cuda) for _ in range(args.calls)]
        for i, pass_ in ((0, "forward"), (2, "backward")):
            host, dev = statistics.median(lap[i] for lap in laps), statistics.median(lap[i + 1] for lap in laps)
            print(f"{name} {pass_}: host {host:.0f} us ({host / experts:.0f} us an expert; min "
                  f"{min(lap[i] for lap in laps):.0f}, max {max(lap[i] for lap in laps):.0f}), device {dev:.0f} us "
                  f"({dev / experts:.0f} an expert), over {args.calls} calls")
    if cuda:
        for pass_, us in recipe_us(run_cfg, device).items():
            print(f"host recipe for an expert's {pass_}, priced by this machine's host sweep: {us:.0f} us")
        for name, us in swiglu_host_us(device).items():
            print(f"compiled SwiGLU on 16 columns, {name}: host {us:.1f} us a call")
    print(f"device: {torch.cuda.get_device_name(device) if cuda else 'cpu'}, torch {torch.__version__}")
    print(f"command: python3 runs/bench/expert_host.py --calls {args.calls} --model {args.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
