"""Rotary position embedding (RoPE), rotate-half layout as Megatron's apply_rotary_pos_emb_bshd (and HF Llama).

For head dim d, frequency i < d/2 is base^(-2i/d); position p rotates the pair (x_i, x_{i+d/2}) by p * freq_i:
    out = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1].
cos/sin are computed in fp32, cast to the activation dtype (as Megatron does) and cached per (length, device,
dtype): they are the same for every layer and every step, so recomputing them per layer would be pure overhead.
Llama 3's long-context frequency rescaling is not applied (it only matters beyond the 8k original context).
Under context parallelism a rank holds two non-adjacent chunks of the sequence (engine.context_parallel), so its
angles are those of the chunks' true positions, not of 0 .. s/C - 1: a token must rotate as it would in the whole
sequence, or q k^T between chunks of different ranks would see the wrong relative distance.
"""
from __future__ import annotations

import torch

from engine.context_parallel import cp_positions


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, rotary_base: float, cp_size: int = 1, cp_rank: int = 0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
        self.head_dim, self.rotary_base = head_dim, rotary_base
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self._cache: dict[tuple[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [s, 1, 1, d]: broadcast over batch and heads of [s, b, n, d] activations; seq_len is this
        rank's length (s/C under context parallelism), rotated at the global positions of its chunks."""
        key = (seq_len, device, dtype)
        if key not in self._cache:
            exponent = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
            inv_freq = 1.0 / (self.rotary_base ** exponent)
            positions = cp_positions(seq_len * self.cp_size, self.cp_size, self.cp_rank)
            angles = torch.outer(positions.to(device=device, dtype=torch.float32), inv_freq)
            angles = torch.cat((angles, angles), dim=-1)[:, None, None, :]
            self._cache[key] = (angles.cos().to(dtype), angles.sin().to(dtype))
        return self._cache[key]


def apply_rotary_pos_emb(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate t [s, b, n, d] by the angles in cos/sin [s, 1, 1, d].

    Written half by half, [x1 c - x2 s, x2 c + x1 s], rather than t cos + rotate_half(t) sin: the same numbers in
    eager (bit for bit), but no rotate_half intermediate, so compiled (inside attention's jit_fuser function) the
    two halves are computed straight into the output.
    """
    x1, x2 = t.chunk(2, dim=-1)
    cos1, cos2 = cos.chunk(2, dim=-1)
    sin1, sin2 = sin.chunk(2, dim=-1)
    return torch.cat((x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2), dim=-1)
