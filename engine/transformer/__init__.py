"""Llama-style transformer building blocks (Megatron Core transformer/)."""
