"""Mixture of experts (Megatron's MoELayer with the all-to-all token dispatcher): docs/engine.md, "Mixture of
experts"."""
