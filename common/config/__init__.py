"""The run configuration schema: dataclasses, presets and their validation, torch-free.

The resolved config is written into the run directory's manifest (`RunConfig.to_dict`) and read back from it
(`RunConfig.from_dict`); that dict is the contract between the engine and the ledger, not this package's objects.
Command-line flags become a RunConfig in common.arguments (Megatron's arguments.py); `validate` holds every check
Megatron's validate_args makes for the features we have, so a config built any other way is checked the same.

One concern a module: each config dataclass beside its own checks (model_config, parallel_config, train_config,
probe_config, recompute_config, checkpoint_config, implementation_config; run_config holds RunConfig and the checks
between configs), limits (every number's range), validation (`validate`, all of them in order), presets (the
published models), checkpoint_layout (the checkpoint directory's contract) and pipeline_layers (which layers each
pipeline stage and virtual chunk builds, for the engine and the ledger).
"""
from common.config.checkpoint_config import CheckpointConfig, check_checkpoint_flags
from common.config.checkpoint_layout import (
    CHECKPOINT_LAYOUT_FILE,
    LATEST_CHECKPOINT_FILE,
    LAYOUT_DEFAULTS,
    LAYOUT_MODEL_FIELDS,
    check_load_layout,
    checkpoint_dir_name,
    checkpoint_layout,
    latest_checkpoint,
    layout_differences,
)
from common.config.implementation_config import (
    CUDA_GRAPH_IMPLS,
    ENGINE_ATTENTION_BACKENDS,
    FP8_FORMATS,
    FP8_RECIPES,
    ImplementationConfig,
    check_implementation,
    jit_fuser_compile_from_environment,
)
from common.config.limits import (
    MAX_LAYERS,
    MAX_TOKENS,
    MAX_WIDTH,
    MAX_WORLD_SIZE,
    check_ranges,
)
from common.config.model_config import (
    CROSS_ENTROPY_FUSION_IMPLS,
    LINEAR_CROSS_ENTROPY_CHUNK_TOKENS,
    ModelConfig,
    check_cross_entropy_fusion,
)
from common.config.parallel_config import ParallelConfig
from common.config.presets import PRESETS, TYING_SOURCES, tying_reason
from common.config.probe_config import ProbeConfig
from common.config.recompute_config import RecomputeConfig, check_recompute
from common.config.run_config import RunConfig, check_engine_support, check_moe
from common.config.train_config import TrainConfig, check_ddp_flags
from common.config.validation import validate

__all__ = [
    "CROSS_ENTROPY_FUSION_IMPLS", "CUDA_GRAPH_IMPLS", "ENGINE_ATTENTION_BACKENDS", "FP8_FORMATS", "FP8_RECIPES",
    "LINEAR_CROSS_ENTROPY_CHUNK_TOKENS", "check_cross_entropy_fusion",
    "CHECKPOINT_LAYOUT_FILE", "LATEST_CHECKPOINT_FILE", "LAYOUT_DEFAULTS", "LAYOUT_MODEL_FIELDS", "MAX_LAYERS",
    "MAX_TOKENS", "MAX_WIDTH", "MAX_WORLD_SIZE", "PRESETS", "CheckpointConfig", "ImplementationConfig", "ModelConfig",
    "ParallelConfig", "ProbeConfig", "RecomputeConfig", "RunConfig", "TrainConfig", "check_checkpoint_flags",
    "jit_fuser_compile_from_environment",
    "check_ddp_flags", "check_engine_support", "check_implementation", "check_load_layout", "check_moe",
    "check_ranges", "check_recompute", "checkpoint_dir_name", "checkpoint_layout", "latest_checkpoint",
    "layout_differences", "validate",
    "TYING_SOURCES", "tying_reason",
]
