"""Static memory of one (tp, pp, dp) rank, to the byte, by component.

Built from the buffer layout (buffer_layout.py) and the component rules of bytes_per_param.py:
- param buffer: buffer numel (padding included) x param bytes; grad buffer: numel x grad bytes;
- the optimizer's state covers the parameter elements the rank owns: all of them without the distributed optimizer,
  its shard's real elements with it (padding never gets main params or Adam state);
- fp32 main params (16-bit params only), the fp32 grad copy (16-bit grads only, from the first step), Adam m and v
  (from the first step: torch's Adam creates them lazily).
`padding_bytes` is the part of the two buffers that is padding; it is included in them, not added again.
TP rank does not change any figure (matrices split evenly, norms replicated) but is checked for range.
Context parallelism: the buffers are reduced, and the distributed optimizer shards, over the dp x cp ranks of
Megatron's dp_cp group (buffer_layout.dp_cp_size), so `dp_rank` is the rank's index in that group (its DP rank at
cp 1) and the optimizer state of a rank of CP2 x DP2 is that of DP4.
Mixture of experts: a rank also holds its expert buffers (buffer_layout.expert_rank_buffers), whose optimizer state
is its shard over the expert-data-parallel group; `expert_dp_rank` gives its index there. Under Megatron's default
order (tp-cp-ep-dp-pp) a rank's index w in its dp x cp group is also its place on the expert grid within its TP rank
and stage (the dense grid counts cp fastest then dp, the expert grid ep fastest then expert dp, over the same
world / (tp x pp) ranks), so its expert-dp index is w // EP (`expert_dp_rank_of`). The totals are dense + expert;
`static_bytes_split` keeps the two apart.
"""
from __future__ import annotations

from dataclasses import asdict, astuple, dataclass

from common.config import RunConfig
from common.errors import ConfigError
from ledger.models.formulas.buffer_layout import (
    BufferLayout,
    dp_cp_size,
    expert_dp_size,
    expert_rank_buffers,
    rank_buffers,
)
from ledger.models.formulas.bytes_per_param import (
    DTYPE_BYTES,
    PHASES,
    grad_copy_bytes,
    master_param_bytes,
)


@dataclass(frozen=True)
class StaticBytes:
    param_buffer: int
    grad_buffer: int
    padding: int
    master_params: int
    grad_fp32_copy: int
    adam_m: int
    adam_v: int

    @property
    def total(self) -> int:
        return (self.param_buffer + self.grad_buffer + self.master_params + self.grad_fp32_copy
                + self.adam_m + self.adam_v)

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}

    def __add__(self, other: "StaticBytes") -> "StaticBytes":
        return StaticBytes(*(a + b for a, b in zip(astuple(self), astuple(other))))


NOTHING = StaticBytes(0, 0, 0, 0, 0, 0, 0)


def _check_rank(name: str, value: int, size: int) -> None:
    if not 0 <= value < size:
        raise ConfigError(f"{name} {value} is outside 0..{size - 1}")


def owned_param_elements(cfg: RunConfig, pp_rank: int, dp_rank: int) -> int:
    """Parameter elements whose optimizer state lives on this rank."""
    return owned_per_dp_rank(cfg, pp_rank)[dp_rank]


def owned_per_dp_rank(cfg: RunConfig, pp_rank: int, buffers: list[BufferLayout] | None = None) -> list[int]:
    """owned_param_elements of every rank of the dp x cp group of a pipeline rank, in one pass over its buffers
    (rank_buffers)."""
    dp = dp_cp_size(cfg)
    buffers = rank_buffers(cfg, pp_rank) if buffers is None else buffers
    if cfg.train.use_distributed_optimizer:
        return [sum(per_rank) for per_rank in zip(*(b.owned_per_rank(dp) for b in buffers))]
    return [sum(b.numel_unpadded for b in buffers)] * dp


def expert_dp_rank_of(cfg: RunConfig, dp_rank: int) -> int:
    """The expert-dp index of the rank whose index in its dp x cp group is `dp_rank` (module docstring: Megatron's
    default order)."""
    return dp_rank // cfg.parallel.expert_model_parallel_size


def expert_owned_per_rank(cfg: RunConfig, pp_rank: int) -> list[int]:
    """Expert parameter elements whose optimizer state each rank of the expert-dp group owns."""
    buffers, edp = expert_rank_buffers(cfg, pp_rank), expert_dp_size(cfg)
    if not buffers:
        return [0] * edp
    if cfg.train.use_distributed_optimizer:
        return [sum(per_rank) for per_rank in zip(*(b.owned_per_rank(edp) for b in buffers))]
    return [sum(b.numel_unpadded for b in buffers)] * edp


def static_bytes_split(cfg: RunConfig, tp_rank: int, pp_rank: int, dp_rank: int,
                       phase: str = "after_first_step") -> dict[str, StaticBytes]:
    """A rank's static bytes in its dense part and its expert part (zero for a dense model); `dp_rank` is the index
    in the dp x cp group."""
    p = cfg.parallel
    _check_rank("tp rank", tp_rank, p.tensor_model_parallel_size)
    _check_rank("pp rank", pp_rank, p.pipeline_model_parallel_size)
    _check_rank("dp rank", dp_rank, dp_cp_size(cfg))  # the index in the dp x cp group (module docstring)
    dense = _static_bytes(cfg, rank_buffers(cfg, pp_rank), owned_param_elements(cfg, pp_rank, dp_rank), phase)
    experts = expert_rank_buffers(cfg, pp_rank)
    expert = (_static_bytes(cfg, experts, expert_owned_per_rank(cfg, pp_rank)[expert_dp_rank_of(cfg, dp_rank)],
                            phase) if experts else NOTHING)
    return {"dense": dense, "expert": expert}


def static_bytes(cfg: RunConfig, tp_rank: int, pp_rank: int, dp_rank: int,
                 phase: str = "after_first_step") -> StaticBytes:
    parts = static_bytes_split(cfg, tp_rank, pp_rank, dp_rank, phase)
    return parts["dense"] + parts["expert"]


def _static_bytes(cfg: RunConfig, buffers: list[BufferLayout], owned: int, phase: str) -> StaticBytes:
    """A rank with these buffers whose optimizer state covers `owned` parameter elements."""
    if phase not in PHASES:
        raise ConfigError(f"unknown phase {phase!r} (one of {', '.join(PHASES)})")
    stepped = phase == "after_first_step"
    numel = sum(b.numel for b in buffers)
    padding = sum(b.padding for b in buffers)
    pb, gb = DTYPE_BYTES[cfg.train.params_dtype], DTYPE_BYTES[cfg.train.grad_dtype]
    return StaticBytes(
        param_buffer=numel * pb,
        grad_buffer=numel * gb,
        padding=padding * (pb + gb),
        master_params=owned * master_param_bytes(cfg.train.params_dtype),
        grad_fp32_copy=owned * grad_copy_bytes(cfg.train.grad_dtype) if stepped else 0,
        adam_m=owned * 4 if stepped else 0,
        adam_v=owned * 4 if stepped else 0,
    )


def largest_dp_rank(cfg: RunConfig, pp_rank: int, phase: str = "after_first_step") -> tuple[int, StaticBytes]:
    """The rank of pipeline rank `pp_rank`'s dp x cp group with the largest static total (the first of equals), and
    its bytes. Only the optimizer state differs between DP ranks, so each distinct owned count is priced once."""
    buffers = rank_buffers(cfg, pp_rank)
    owned = owned_per_dp_rank(cfg, pp_rank, buffers)
    by_owned = {n: _static_bytes(cfg, buffers, n, phase) for n in set(owned)}
    experts = expert_rank_buffers(cfg, pp_rank)
    if not experts:
        total_of = {n: b.total for n, b in by_owned.items()}
        largest = max(total_of.values())
        dp_rank = next(r for r, n in enumerate(owned) if total_of[n] == largest)
        return dp_rank, by_owned[owned[dp_rank]]
    # each dp x cp rank adds the expert shard of its expert-dp index
    expert_owned = expert_owned_per_rank(cfg, pp_rank)
    by_expert = {n: _static_bytes(cfg, experts, n, phase) for n in set(expert_owned)}
    per_rank = [by_owned[n] + by_expert[expert_owned[expert_dp_rank_of(cfg, r)]] for r, n in enumerate(owned)]
    largest = max(b.total for b in per_rank)
    dp_rank = next(r for r, b in enumerate(per_rank) if b.total == largest)
    return dp_rank, per_rank[dp_rank]


def static_bytes_per_stage(cfg: RunConfig, phase: str = "after_first_step") -> list[StaticBytes]:
    """Each pipeline rank's static bytes on its largest DP rank (the one that decides whether the stage fits)."""
    return [largest_dp_rank(cfg, pp, phase)[1] for pp in range(cfg.parallel.pipeline_model_parallel_size)]


def static_bytes_max(cfg: RunConfig, phase: str = "after_first_step") -> tuple[int, tuple[int, int, int]]:
    """The largest static total over all ranks, and one (tp, pp, dp) rank that has it (the first in (pp, dp)
    order)."""
    per_stage = [largest_dp_rank(cfg, pp, phase) for pp in range(cfg.parallel.pipeline_model_parallel_size)]
    pp = max(range(len(per_stage)), key=lambda i: per_stage[i][1].total)
    return per_stage[pp][1].total, (0, pp, per_stage[pp][0])
