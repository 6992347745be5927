"""Tensor-parallel layers, mappings, vocab-parallel cross entropy and seeded init (Megatron Core tensor_parallel)."""
