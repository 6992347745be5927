"""A synthetic multi-rank "training loop" (one small nn.Linear, micro-batches, DP/TP/PP collectives) that drives the
ProbeSet exactly as the engine does, in the engine's order: what the probe tests run on gloo ranks."""
from __future__ import annotations

import tempfile
import time

import torch
import torch.distributed as dist

from common.arguments import parse_args
from engine.parallel_state import ParallelState
from probes.probe_set import create_probe_set

MICROBATCHES = 2
WIDTH = 16


def synthetic_run(rank: int, world_size: int, run_dir: str | None, flags: list[str], tp: int, pp: int, steps: int,
                  step_sleep_s: float = 0.0) -> str:
    """Every facade call the engine makes, in the engine's order; returns the probe set's class name."""
    argv = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--train-iters", str(steps), *flags] + (["--run-dir", run_dir] if run_dir else [])
    cfg = parse_args(argv, world_size=world_size)
    ps = ParallelState.initialize(tp=tp, pp=pp)
    probes = create_probe_set(cfg, ps, argv)
    torch.manual_seed(rank)
    model = torch.nn.Linear(WIDTH, WIDTH)
    probes.memory_point("after_model_build")
    probes.inventory([{"name": "weight", "kind": "param", "dtype": "fp32", "numel": WIDTH * WIDTH,
                       "bytes": 4 * WIDTH * WIDTH, "padding": 0}])
    probes.memory_point("after_ddp_buffers")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probes.memory_point("after_optimizer_init")
    probes.collective_sweep(ps, dp_bucket_numels=[WIDTH * WIDTH, 1000], dp_grad_dtype="fp32",
                            dp_param_dtype="fp32", activation_numel=4 * WIDTH, activation_dtype="fp32")
    for it in range(1, steps + 1):
        t0 = time.perf_counter()
        probes.step_begin(it)
        with probes.range("iteration", "iteration"):
            loss = _forward_backward(probes, model, ps)
            _grad_sync(probes, model, ps)
            with probes.range("optimizer", "optimizer"):
                optimizer.step()
                optimizer.zero_grad()
        time.sleep(step_sleep_s)
        probes.step_end(it, loss=loss, lr=0.1, grad_norm=1.0, tokens=MICROBATCHES * 4,
                        step_time_s=time.perf_counter() - t0)
        if it == 1:
            probes.memory_point("after_first_step")
    probes.close("complete")
    return type(probes).__name__


def _forward_backward(probes, model: torch.nn.Module, ps: ParallelState) -> float:
    total = 0.0
    for mb in range(MICROBATCHES):
        x = torch.randn(4, WIDTH)
        with probes.range(f"forward stage{ps.pp_rank} mb{mb}", "forward", stage=ps.pp_rank, microbatch=mb, chunk=0):
            y = model(x)
            if ps.tp_size > 1:
                with probes.range("tp all-reduce", "tp-comm", stage=ps.pp_rank, microbatch=mb):
                    dist.all_reduce(y, group=ps.groups["tp"])
            loss = y.pow(2).mean()
        if ps.pp_size > 1:
            with probes.range(f"send-recv stage{ps.pp_rank} mb{mb}", "pp-comm", stage=ps.pp_rank, microbatch=mb):
                recv = torch.empty_like(y)
                ops = [dist.P2POp(dist.isend, y.detach(), ps.pipeline_next_rank, ps.groups["pp"]),
                       dist.P2POp(dist.irecv, recv, ps.pipeline_prev_rank, ps.groups["pp"])]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        with probes.range(f"backward stage{ps.pp_rank} mb{mb}", "backward", stage=ps.pp_rank, microbatch=mb,
                          chunk=0):
            loss.backward()
        total += loss.item()
    return total / MICROBATCHES


def _grad_sync(probes, model: torch.nn.Module, ps: ParallelState) -> None:
    group = ps.groups["dp_cp"]
    for bucket, param in enumerate(model.parameters()):
        # a DP group of one has no communicator (engine/parallel_state.py): the reduction is the identity, issued
        # as none, its range kept
        work, token = probes.comm_issue(
            f"all-reduce bucket{bucket}", "dp-comm",
            lambda param=param: dist.all_reduce(param.grad, group=group, async_op=True) if group.size() > 1 else None,
            bucket=bucket, bytes=param.grad.numel() * 4)
        if work is not None:
            work.wait()
        probes.comm_end(token)


def run_until_killed(run_dir: str) -> None:
    """Runs in a subprocess: a one-rank gloo run that would go on for ever, killed from outside."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        synthetic_run(0, 1, run_dir, ["--timers"], 1, 1, 100_000, step_sleep_s=0.02)
