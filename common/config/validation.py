"""`validate`: every check Megatron's validate_args makes for the features we have, so that a config built any other
way than from flags (a manifest, a search candidate, a what-if) is checked the same, one clear message each."""
from __future__ import annotations

from common.config.checkpoint_config import check_checkpoint_flags
from common.config.implementation_config import check_implementation
from common.config.limits import check_ranges
from common.config.model_config import check_attention, check_cross_entropy_fusion, check_positions
from common.config.parallel_config import check_parallel
from common.config.probe_config import check_probes
from common.config.recompute_config import check_recompute
from common.config.run_config import (
    RunConfig,
    check_context_parallel,
    check_cuda_graphs,
    check_fp8,
    check_moe,
    check_pipeline,
    check_sequence_parallel,
    check_tensor_parallel,
)
from common.config.train_config import check_lr_schedule, check_train


def validate(cfg: RunConfig) -> None:
    """Ranges first (every later check divides by a size), then each config's own rules and those between them, in
    the order that decides which of several problems is named. With --sequence-parallel and tp 1 it turns sequence
    parallelism off, as Megatron's validate_args does."""
    check_ranges(cfg)
    check_context_parallel(cfg)
    check_parallel(cfg.parallel)
    check_attention(cfg.model)
    check_tensor_parallel(cfg)
    check_sequence_parallel(cfg)
    check_positions(cfg.model)
    check_pipeline(cfg)
    check_moe(cfg)
    check_cross_entropy_fusion(cfg.model)
    check_train(cfg.train)
    check_recompute(cfg.recompute)
    check_implementation(cfg.implementation)
    check_cuda_graphs(cfg)
    check_fp8(cfg)
    check_checkpoint_flags(cfg.checkpoint, cfg.train.train_iters)
    check_lr_schedule(cfg.train)
    check_probes(cfg.probes, cfg.parallel.world_size)
