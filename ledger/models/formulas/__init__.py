"""The analytic side of the ledger: torch-free formulas, one concept a module.

These are derived from Megatron-LM's documented rules and first principles, never from the engine's code: the
reconciliation holds them against the engine's inventory and the measurements, which proves something only if the
two were derived independently. Every function takes plain numbers or a `common.config.RunConfig` (rebuilt from a
run manifest with `RunConfig.from_dict`). docs/formulas.md has the derivations.

    params          parameter counts per component / layer / stage / TP rank, vocab padding, registration order
    bytes_per_param bytes per parameter by strategy (DDP, ZeRO-1/2/3) and precision; Megatron's table
    buffer_layout   Megatron's param/grad buffer layout: reverse order, 64-element alignment, bucket padding
    static_memory   static bytes per (tp, pp, dp) rank, to the byte, by component
    activations     saved-for-backward bytes per layer / stage, 1F1B and interleaved in-flight counts, recompute
    bubble          pipeline bubble under its three conventions
    comm            communication volume per step per rank, by collective (the expert-parallel all-to-alls apart)
    moe             mixture of experts: capacity, kept assignments, each EP rank's rows sent and received
    nccl_bw         nccl-tests algbw / busbw conversions
    flops           Megatron-LM's num_floating_point_operations, the 6N + 12Lhs convention, MFU
"""
