"""A compact Megatron-Core-style training engine on torch.distributed (names follow Megatron Core 0.18)."""
