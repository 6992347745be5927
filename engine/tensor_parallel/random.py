"""Seeded master-weight initialisation: every rank draws the same full weight and keeps its slice.

Megatron's `_initialize_affine_weight_cpu` draws the full ("master") weight and splits it, so that a model at TP=N
starts from exactly the weights of the TP=1 model. We do the same, and go one step further: the generator's seed is
derived from the run's seed and the parameter's *global* name (`decoder.layers.{global layer}.mlp.linear_fc1.weight`),
never from the stage or rank that builds it, so that a pipeline-parallel (or interleaved) model also starts identical
to a single-process one.

The master weight is drawn on the target device (a CUDA generator on GPU): drawing llama3.2-1b's 262M-entry
embedding on the host would dominate start-up. CPU and CUDA generators give different numbers, so runs compare
bit-for-bit only on the same kind of device. On the meta device nothing is drawn.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MasterWeightInit:
    """N(0, std^2) for one parameter, seeded by (run seed, global parameter name).

    valid_rows: draw only the first rows and zero the rest. The vocabulary padding depends on the TP size, so the
    embedding and output layer draw [vocab_size, h] and pad with zeros: the real rows then match across TP sizes.
    """
    std: float
    seed: int
    name: str
    valid_rows: int | None = None

    @property
    def generator_seed(self) -> int:
        # crc32, not hash(): Python salts str hashes per process, and every rank must derive the same seed.
        return (self.seed * 0x9E3779B1 + zlib.crc32(self.name.encode())) % (1 << 63)

    def draw(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The full master weight, fp32, on device."""
        generator = torch.Generator(device=device)
        generator.manual_seed(self.generator_seed)
        rows = shape[0] if self.valid_rows is None else self.valid_rows
        drawn = torch.randn((rows, *shape[1:]), generator=generator, device=device, dtype=torch.float32)
        drawn.mul_(self.std)
        if rows == shape[0]:
            return drawn
        return torch.cat((drawn, drawn.new_zeros((shape[0] - rows, *shape[1:]))))


def scaled_init_std(std: float, num_layers: int) -> float:
    """Megatron's scaled_init_method_normal for the projections that write into the residual stream (attention
    output, MLP down): std / sqrt(2 L), so that the residual's variance does not grow with depth."""
    return std / math.sqrt(2.0 * num_layers)


def partition(master: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s slice of master along dim. With stride s the dim is cut into s*size equal chunks and a rank
    takes chunks rank, rank+size, ...: a fused [A; B] weight (stride 2) then gives each rank [A_r; B_r]."""
    if master.shape[dim] % (stride * size):
        raise ValueError(f"dim {dim} of {tuple(master.shape)} is not divisible by stride {stride} x TP size {size}")
    chunks = master.chunk(stride * size, dim=dim)
    return torch.cat(chunks[rank::size], dim=dim)


def sharded_master_weight(init: MasterWeightInit, full_shape: tuple[int, ...], *, partition_dim: int | None,
                          stride: int, rank: int, size: int, dtype: torch.dtype,
                          device: torch.device) -> torch.Tensor:
    """This rank's slice (partition_dim None: the whole weight) of the seeded master weight, in dtype."""
    local_shape = list(full_shape)
    if partition_dim is not None:
        local_shape[partition_dim] //= size
    if torch.device(device).type == "meta":
        return torch.empty(local_shape, dtype=dtype, device=device)
    master = init.draw(tuple(full_shape), torch.device(device))
    local = master if partition_dim is None else partition(master, partition_dim, stride, rank, size)
    return local.to(dtype).contiguous()
