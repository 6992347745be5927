"""What Megatron-LM's own GPT model keeps for backward and allocates at its peak, measured on CPU: the evidence the
ledger's Megatron-LM memory formulas are held to (tests/fixtures/megatron_lm_cpu_memory, tests/test_megatron_memory.py).

    MEGATRON_LM=.mlm python3 runs/megatron/megatron_cpu_memory.py --out FILE.json -- <pretrain_gpt.py flags>

Builds the model exactly as pretrain_gpt.py does (Megatron's own parse_args, validate_args and gpt_builders.gpt_builder,
its layer spec, --use-cpu-initialization added) from a Megatron-LM source tree, runs one micro-batch forward and
backward to warm it up (Megatron's global memory buffer is allocated there, as in a run's first step), then one more,
and writes:
  saved        every tensor autograd keeps for backward in that forward (torch.autograd.graph.saved_tensors_hooks),
               one entry per storage (a view counts its storage once), parameters left out: shape, dtype, bytes of
               the storage, the op that saved it
  peak         the CPU allocator's most bytes above the step's start, from the profiler's memory events, the op
               running at that moment and the live blocks of 256 KiB or more with the op that allocated each
What is changed so that Megatron runs on a CPU with no GPU package: torch.cuda.current_device answers "cpu" (Megatron
allocates with device=torch.cuda.current_device()); the CUDA RNG tracker's fork is a no-op (no dropout); a stand-in
`triton` module lets Megatron's module-level kernels import; jit_fuser (torch.compile) is the identity; Python 3.11's
typing gets `override`. One change of substance, so that the numbers are those of a GPU: torch's CPU rms_norm is a
composite of ops that keeps fp32 copies of its input, so RMSNorm runs through a function with the contract of the
CUDA kernel aten::_fused_rms_norm (it keeps its input and the fp32 rstd, nothing else). A GPU would also hold cuBLAS
workspaces, which are not activations and do not appear here.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import types
import typing
from pathlib import Path


def stand_ins() -> None:
    """The changes listed in the module docstring that let Megatron import and run on CPU."""
    import torch
    import torch._inductor.runtime.hints  # noqa: F401  torch's compile stack reads triton's absence first
    import torch.utils._triton as torch_triton

    torch_triton.has_triton_package()
    torch_triton.has_triton()
    typing.override = getattr(typing, "override", lambda f: f)
    triton = types.ModuleType("triton")
    triton.__version__ = "0.0.0"
    triton.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    triton.autotune = triton.heuristics = lambda *a, **kw: (lambda f: f)
    triton.Config = lambda *a, **kw: None
    language = types.ModuleType("triton.language")

    def annotation(name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return object

    language.__getattr__ = annotation
    language.constexpr = lambda value=None: value
    triton.language = language
    sys.modules.update({"triton": triton, "triton.language": language})
    torch.cuda.current_device = lambda: "cpu"
    torch.compile = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    torch.nn.functional.rms_norm = fused_rms_norm


def fused_rms_norm(x, normalized_shape, weight=None, eps=None):
    """RMSNorm with aten::_fused_rms_norm's contract on CUDA: saves its input and the fp32 rstd."""
    import torch

    class FusedRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + (eps or 1e-6))
            ctx.save_for_backward(x, weight, rstd)
            return ((x.float() * rstd) * weight.float()).to(x.dtype)

        @staticmethod
        def backward(ctx, dy):
            x, weight, rstd = ctx.saved_tensors
            xhat = x.float() * rstd
            gw = (dy.float() * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
            g = dy.float() * weight.float()
            dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
            return dx.to(x.dtype), gw

    return FusedRMSNorm.apply(x, weight)


def parsed(megatron: Path, flags: list[str]):
    """Megatron's arguments for `flags` after its own parse_args and validate_args (a layer spec named by --spec
    imported too), as pretrain_gpt.py would have them on one rank."""
    sys.path[:0] = [str(megatron), str(Path(__file__).resolve().parent)]
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as rng

    rng.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args

    sys.argv = ["pretrain_gpt.py", *flags, "--use-cpu-initialization"]
    args = parse_args()
    with contextlib.redirect_stdout(io.StringIO()):
        validate_args(args, {})
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = -(-args.vocab_size // multiple) * multiple  # what the tokenizer's setup would set
    global_vars.set_args(args)
    if args.spec:
        from megatron.core.transformer.spec_utils import import_module

        assert import_module(args.spec) is not None, f"--spec {args.spec} does not import"
    return args


def build(megatron: Path, flags: list[str]):
    """Megatron's model for `flags`, on CPU, in training mode."""
    args = parsed(megatron, flags)
    from gpt_builders import gpt_builder

    model = gpt_builder(args, True, True)
    model.train()
    return model, args


def batch(args):
    import torch

    b, s = args.micro_batch_size, args.seq_length
    tokens = torch.randint(0, args.vocab_size, (b, s))
    mask = torch.triu(torch.ones(b, 1, s, s, dtype=torch.bool), diagonal=1)  # Megatron's: True where masked out
    return tokens, torch.arange(s).expand(b, s), mask, torch.randint(0, args.vocab_size, (b, s))


def saved_tensors(model, inputs) -> tuple[list[dict], object]:
    """Every storage autograd saves in one forward (parameters left out), and the loss to run backward from."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, dict] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = {"bytes": t.untyped_storage().nbytes(), "dtype": str(t.dtype).removeprefix("torch."),
                         "shape": list(t.shape), "saved_by": t.grad_fn.name() if t.grad_fn is not None else None}
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs[:3], labels=inputs[3])
    return list(seen.values()), loss


def peak(step) -> dict:
    """The step's peak above its start, from the profiler's CPU memory events."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    ops = [e for e in events if e.get("ph") == "X"]
    start = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    top = max(memory, key=lambda e: e["args"]["Total Allocated"])
    live: dict[int, tuple[int, float]] = {}
    for e in memory:
        if e["args"]["Bytes"] > 0:
            live[e["args"]["Addr"]] = (e["args"]["Bytes"], e["ts"])
        else:
            live.pop(e["args"]["Addr"], None)
        if e is top:
            break

    def running(ts: float) -> list[str]:
        return [o["name"] for o in sorted((o for o in ops if o["ts"] <= ts <= o["ts"] + o["dur"]),
                                          key=lambda o: -o["dur"])][1:]
    blocks = sorted(({"bytes": n, "allocated_in": " > ".join(running(ts)[:4])} for n, ts in live.values()
                     if n >= 1 << 18), key=lambda b: -b["bytes"])
    return {"above_start": top["args"]["Total Allocated"] - start, "running": running(top["ts"])[:6],
            "live_blocks": blocks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--parse-only", action="store_true",
                   help="only Megatron's parse_args and validate_args (and --spec's import): a command line's dry run")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then pretrain_gpt.py's flags")
    a = p.parse_args()
    flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    megatron = Path(os.environ.get("MEGATRON_LM", ".mlm")).resolve()
    stand_ins()
    import torch

    if a.parse_only:
        args = parsed(megatron, flags)
        print(f"Megatron-LM parses and validates the flags: {args.num_layers} layers, micro-batch "
              f"{args.micro_batch_size}, transformer_impl {args.transformer_impl}, spec {args.spec}")
        return
    if a.out is None:
        p.error("--out is required")

    model, args = build(megatron, flags)
    inputs = batch(args)
    model(*inputs[:3], labels=inputs[3]).float().sum().backward()  # the warm-up step
    saved, loss = saved_tensors(model, inputs)
    loss.float().sum().backward()
    result = {"megatron_sha": (megatron / "MEGATRON_SHA").read_text().strip()
              if (megatron / "MEGATRON_SHA").is_file() else None,
              "torch": torch.__version__, "flags": flags, "saved": saved,
              "saved_bytes": sum(s["bytes"] for s in saved),
              "peak": peak(lambda: model(*inputs[:3], labels=inputs[3]).float().sum().backward())}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    top = result["peak"]
    print(f"{a.out}: {len(saved)} saved storages, {result['saved_bytes']:,} B; peak {top['above_start']:,} B above the "
          f"step's start, in {' > '.join(top['running'][:3])}")


if __name__ == "__main__":
    main()
