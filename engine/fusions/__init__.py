"""Fused computations that span layers (Megatron Core's fusions): the output layer fused into the loss."""
