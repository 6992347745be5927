"""Models built from the transformer blocks (Megatron Core models/)."""
