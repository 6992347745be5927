"""Which decoder layers each pipeline stage and virtual chunk builds (Megatron-Core's get_num_layers_to_build and
get_transformer_layer_offset), for the engine and the ledger alike.

Even stages hold L / p layers each. Uneven ones (Megatron-LM's --decoder-first-pipeline-num-layers and
--decoder-last-pipeline-num-layers, as Llama 3 405B's 126 layers over 16 stages: 7, 8 x 14, 7) give the first and/or
last stage their own count and split the rest evenly over the stages between. Under the interleaved schedule every
stage's layers divide into v equal chunks, and virtual chunk c of stage r starts where chunk c of the whole model
starts (c L / v) plus the chunk-c layers of the stages before r.
"""
from __future__ import annotations

from common.config.parallel_config import ParallelConfig
from common.errors import ConfigError

FIRST_FLAG, LAST_FLAG = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"


def is_uneven(p: ParallelConfig) -> bool:
    return p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None


def _middle(p: ParallelConfig, num_layers: int) -> tuple[int, int]:
    """(stages between the ones with their own count, the layers they share)."""
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    stages = p.pipeline_model_parallel_size - (first is not None) - (last is not None)
    return stages, num_layers - (first or 0) - (last or 0)


def stage_num_layers(p: ParallelConfig, num_layers: int, pp_rank: int) -> int:
    """Decoder layers pipeline stage pp_rank builds, over all its chunks."""
    if pp_rank == 0 and p.decoder_first_pipeline_num_layers is not None:
        return p.decoder_first_pipeline_num_layers
    if pp_rank == p.pipeline_model_parallel_size - 1 and p.decoder_last_pipeline_num_layers is not None:
        return p.decoder_last_pipeline_num_layers
    stages, layers = _middle(p, num_layers)
    return layers // stages


def chunk_num_layers(p: ParallelConfig, num_layers: int, pp_rank: int) -> int:
    """Decoder layers in each virtual chunk of stage pp_rank (every chunk of a stage holds as many)."""
    return stage_num_layers(p, num_layers, pp_rank) // (p.virtual_pipeline_model_parallel_size or 1)


def chunk_layer_numbers(p: ParallelConfig, num_layers: int, pp_rank: int, chunk: int) -> range:
    """Global (0-based) layer numbers of stage pp_rank's virtual chunk `chunk`."""
    v = p.virtual_pipeline_model_parallel_size or 1
    if not 0 <= pp_rank < p.pipeline_model_parallel_size or not 0 <= chunk < v:
        raise ConfigError(f"stage {pp_rank} chunk {chunk} is outside a pipeline of "
                          f"{p.pipeline_model_parallel_size} x {v} chunks")
    start = chunk * (num_layers // v) + sum(chunk_num_layers(p, num_layers, r) for r in range(pp_rank))
    return range(start, start + chunk_num_layers(p, num_layers, pp_rank))


def check_pipeline_layers(p: ParallelConfig, num_layers: int) -> None:
    """Megatron's checks of the split: even stages divide the layers into p x v; uneven ones need a pipeline, counts
    >= 1, the middle layers divisible over the middle stages (none of either, or some of both), and under the
    interleaved schedule every stage's count divisible by v."""
    pp, v = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    if not is_uneven(p):
        if num_layers % (pp * v):
            raise ConfigError(f"--num-layers {num_layers} is not divisible by pipeline size {pp} x virtual size {v}"
                              f" (give {FIRST_FLAG} / {LAST_FLAG} for uneven stages)")
        return
    if pp < 2:
        raise ConfigError(f"{FIRST_FLAG} / {LAST_FLAG} need --pipeline-model-parallel-size > 1, got {pp}")
    for flag, count in ((FIRST_FLAG, p.decoder_first_pipeline_num_layers),
                        (LAST_FLAG, p.decoder_last_pipeline_num_layers)):
        if count is not None and count % v:
            raise ConfigError(f"{flag} {count} is not divisible by virtual pipeline size {v}")
    stages, layers = _middle(p, num_layers)
    if layers < 0 or bool(stages) != bool(layers):
        raise ConfigError(f"{FIRST_FLAG} / {LAST_FLAG} leave {layers} of --num-layers {num_layers} for {stages} "
                          "middle stage(s)")
    if stages and layers % (stages * v):
        raise ConfigError(f"the {layers} middle layers are not divisible by {stages} middle stage(s) x virtual "
                          f"pipeline size {v}")
