"""Context parallelism's load-balanced sequence split, as Megatron's get_batch_on_this_cp_rank.

The sequence is cut into 2C equal chunks and CP rank i keeps chunks i and 2C - 1 - i. Why not C contiguous slices:
under a causal mask a token attends to every token before it, so the rank holding the last slice would do C times
the attention work of the first and every ring step would wait for it. Pairing an early chunk with its mirror gives
every rank the same work (chunk i sees i + 1/2 chunks' worth of keys, its mirror 2C - i - 1/2: 2C in all), which is
also what lets ring attention's off-diagonal steps be one unmasked half-block each (engine/transformer/
ring_attention.py). Tokens, labels and the RoPE positions are cut by the same rule, so every token keeps its true
position and label.
"""
from __future__ import annotations

import torch


def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of the 2C sequence chunks CP rank `cp_rank` holds, in sequence order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_positions(seq_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The global positions (int64) of this CP rank's seq_length / C tokens."""
    return get_batch_on_this_cp_rank(torch.arange(seq_length), cp_size, cp_rank, dim=0)


def get_batch_on_this_cp_rank(tensor: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's chunks of `tensor` along its sequence dim (1 for [b, s] tokens and labels), concatenated in
    sequence order; the tensor itself when cp_size is 1."""
    if cp_size == 1:
        return tensor
    length = tensor.shape[dim]
    if length % (2 * cp_size):
        raise ValueError(f"sequence of {length} tokens does not split into 2 x {cp_size} chunks")
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[c] for c in cp_chunk_ids(cp_size, cp_rank)], dim=dim)
