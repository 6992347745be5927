"""The parity harness: run pretrain in a process group and compare it with the same run on a world of one.

`train_and_collect` runs the whole loop in the current process group and returns the per-step figures and the full
(TP-assembled) parameters; `reference_run` is the same configuration on a world of one. Every parity test (training,
pipeline, multi-node) compares the two with `assert_close_rel` to 1e-5 relative: a parallel layout may change
nothing but fp32 summation order.
"""
from __future__ import annotations

import copy
import functools
import re
from typing import Any, Sequence

import torch
import torch.distributed as dist

from common.arguments import parse_args
from common.config import ParallelConfig, RunConfig
from engine.parallel_state import ParallelState
from engine.training import pretrain
from tests.support.gloo import world_of_one

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
# The last stage's copy of tied embeddings (Megatron's `shared` weight) stands for the one weight the single-process
# model has under this name, so both stages' copies are held against it.
TIED_EMBEDDING = "embedding.weight"


def _global_name(name: str, chunk: torch.nn.Module) -> str:
    """A chunk numbers its layers from 0; the single-process model's name uses the layer's global number."""
    match = _LAYER.match(name)
    if match is None:
        return name
    return f"decoder.layers.{chunk.decoder.layers[int(match[1])].layer_number}.{match[2]}"


def full_parameters(model: list[torch.nn.Module], parallel_state: ParallelState) -> dict[str, torch.Tensor]:
    """This rank's parameters by their single-process name (a tied embedding's copy by the embedding's), fp32 on
    the CPU, each TP shard all-gathered over the TP group and reassembled along its partition_dim (honouring
    partition_stride). Collective over the TP group."""
    tp = parallel_state.tp_size
    full: dict[str, torch.Tensor] = {}
    for chunk in model:
        module = chunk.module
        for name, param in module.named_parameters():
            value = param.detach()
            if getattr(param, "tensor_model_parallel", False) and tp > 1:
                shards = [torch.empty_like(value) for _ in range(tp)]
                dist.all_gather(shards, value.contiguous(), group=parallel_state.groups["tp"])
                dim, stride = param.partition_dim, param.partition_stride
                pieces = [shard.chunk(stride, dim=dim) for shard in shards]
                value = torch.cat([pieces[r][s] for s in range(stride) for r in range(tp)], dim=dim)
            name = TIED_EMBEDDING if getattr(param, "shared", False) else _global_name(name, module)
            full[name] = value.float().cpu()
    return full


def train_and_collect(run_config: RunConfig, device: torch.device | None = None,
                      probes: Any = None) -> dict[str, Any]:
    """Run pretrain in the current process group (initialised by the caller) and return, on every rank, the
    per-step losses, grad norms and learning rates and this rank's full parameters: what parity tests compare.
    probes (default none) is what the engine reports to, for tests that also count what it did."""
    device = device or torch.device("cpu")
    parallel_state = ParallelState.from_run_config(run_config)
    result = pretrain(run_config, parallel_state, device, probes)
    steps = result.steps
    return {"losses": [s.loss for s in steps], "grad_norms": [s.grad_norm for s in steps], "lrs": [s.lr for s in steps],
            "params": full_parameters(result.model, parallel_state), "coordinates": parallel_state.coordinates}


def single_process_config(run_config: RunConfig) -> RunConfig:
    """The same model, data and optimizer on a world of one. The vocabulary is padded as the parallel run pads it
    (to a multiple of divisible_by x TP), so both models have the same embedding shape."""
    reference = copy.deepcopy(run_config)
    reference.model.make_vocab_size_divisible_by *= run_config.parallel.tensor_model_parallel_size
    reference.parallel = ParallelConfig(world_size=1)
    reference.train.use_distributed_optimizer = False
    reference.train.overlap_grad_reduce = reference.train.overlap_param_gather = False
    reference.probes.run_dir = None
    return reference


def reference_run(run_config: RunConfig) -> dict[str, Any]:
    """`train_and_collect` of single_process_config(run_config), in this process on a world of one (its own gloo
    group when none is initialised)."""
    reference = single_process_config(run_config)
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("reference_run needs a world of one; call it outside the distributed run")
        return train_and_collect(reference)
    with world_of_one():
        return train_and_collect(reference)


def train_alone(argv: list[str], probes: Any = None) -> dict[str, Any]:
    """`train_and_collect` of these flags on a world of one, in this process (its own gloo group)."""
    with world_of_one():
        return train_and_collect(parse_args(argv, world_size=1), probes=probes)


def assert_flags_change_no_training(base: list[str], flags: list[str], *, param_rtol: float = 1e-5,
                                    param_atol: float = 1e-6) -> None:
    """Training with `flags` added to `base` (each on a world of one) is training without them: the same losses and
    grad norms to 1e-5 relative, the same parameters to param_rtol / param_atol. What a lever that must not change
    the maths (a fusion, another GEMM path, padding) is held to."""
    plain, changed = train_alone(base), train_alone(base + flags)
    assert_close_rel(changed["losses"], plain["losses"], "loss")
    assert_close_rel(changed["grad_norms"], plain["grad_norms"], "grad norm")
    assert changed["params"].keys() == plain["params"].keys()
    for name, value in changed["params"].items():
        torch.testing.assert_close(value, plain["params"][name], rtol=param_rtol, atol=param_atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def built_alone(argv: list[str]) -> torch.nn.Module:
    """The model of these flags on a world of one, on the CPU, untrained: its one chunk (no DDP wrapper)."""
    from engine.models.gpt_model import build_model_chunks

    cfg = parse_args(argv, world_size=1)
    with world_of_one():
        (chunk,) = build_model_chunks(cfg, ParallelState.from_run_config(cfg), "cpu")
    return chunk


def train_rank(rank: int, world_size: int, argv: list[str]) -> dict[str, Any]:
    """One gloo rank of a parity test (tests.support.gloo.run_distributed calls it by name)."""
    return train_and_collect(parse_args(argv, world_size=world_size))


@functools.lru_cache(maxsize=None)
def reference(base: tuple[str, ...], tp: int) -> dict[str, Any]:
    """reference_run of the flags `base` with the vocabulary padded as TP=tp pads it, cached per (flags, tp): every
    layout of a test file with the same TP compares against one single-process run."""
    return reference_run(parse_args([*base, "--tensor-model-parallel-size", str(tp)], world_size=tp))


def flag_value(flags: Sequence[str], name: str, default: int = 1) -> int:
    return int(flags[flags.index(name) + 1]) if name in flags else default


def assert_close_rel(actual: Any, expected: Any, what: str, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), rtol=rtol, atol=0,
                               msg=lambda m: f"{what}: {m}")


def assert_rank_matches(res: dict[str, Any], ref: dict[str, Any], rank: int, *, rtol: float = 1e-4,
                        atol: float = 5e-5) -> None:
    """One rank of a parallel run against the single-process reference: losses and grad norms to 1e-5 relative, and
    every parameter the rank holds (all of them, or its experts' share under EP) to rtol / atol."""
    assert_close_rel(res["losses"], ref["losses"], f"rank {rank} loss")
    assert_close_rel(res["grad_norms"], ref["grad_norms"], f"rank {rank} grad norm")
    assert res["params"].keys() <= ref["params"].keys()
    for name, value in res["params"].items():
        torch.testing.assert_close(value, ref["params"][name], rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"rank {rank} {n}: {m}")
