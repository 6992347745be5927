"""Which decoder layers each pipeline stage and virtual chunk builds (Megatron-Core's get_num_layers_to_build and
get_transformer_layer_offset), for the engine and the ledger alike.

The model is cut into p x v virtual stages, virtual stage c p + r being chunk c of pipeline stage r, each a run of
consecutive layers in virtual-stage order. How many layers each holds:
  * even: L / (p v);
  * uneven (Megatron-LM's --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers): the first and/or
    last stage its own count, the stages between the rest in equal shares, every stage's count split into v equal
    chunks;
  * the embedding and/or the loss counted as a layer (--account-for-embedding-in-pipeline-split /
    --account-for-loss-in-pipeline-split): (L + 1 or 2) / (p v) each, the first virtual stage one fewer for the
    embedding, the last one fewer for the loss. Llama 3 405B's 126 layers over 16 stages with 8 chunks each is
    this: one layer a chunk, the first chunk the embedding alone, the last the output layer and loss alone.
"""
from __future__ import annotations

from common.config.parallel_config import ParallelConfig
from common.errors import ConfigError

FIRST_FLAG, LAST_FLAG = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG, LOSS_FLAG = "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"


def is_uneven(p: ParallelConfig) -> bool:
    return p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None


def accounts_for_ends(p: ParallelConfig) -> bool:
    return p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split


def _middle(p: ParallelConfig, num_layers: int) -> tuple[int, int]:
    """(stages between the ones with their own count, the layers they share)."""
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    stages = p.pipeline_model_parallel_size - (first is not None) - (last is not None)
    return stages, num_layers - (first or 0) - (last or 0)


def _uneven_stage(p: ParallelConfig, num_layers: int, pp_rank: int) -> int:
    if pp_rank == 0 and p.decoder_first_pipeline_num_layers is not None:
        return p.decoder_first_pipeline_num_layers
    if pp_rank == p.pipeline_model_parallel_size - 1 and p.decoder_last_pipeline_num_layers is not None:
        return p.decoder_last_pipeline_num_layers
    stages, layers = _middle(p, num_layers)
    return layers // stages


def virtual_stage_layers(p: ParallelConfig, num_layers: int) -> tuple[int, ...]:
    """Decoder layers of each virtual stage, in virtual-stage order (c p + r: chunk c of stage r); 0 for a chunk that
    holds only the embedding or only the loss."""
    pp, v = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    if is_uneven(p):
        return tuple(_uneven_stage(p, num_layers, r) // v for _ in range(v) for r in range(pp))
    ends = (p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split)
    counts = [(num_layers + sum(ends)) // (pp * v)] * (pp * v)
    counts[0] -= ends[0]
    counts[-1] -= ends[1]
    return tuple(counts)


def stage_num_layers(p: ParallelConfig, num_layers: int, pp_rank: int) -> int:
    """Decoder layers pipeline stage pp_rank builds, over all its chunks."""
    return sum(virtual_stage_layers(p, num_layers)[pp_rank::p.pipeline_model_parallel_size])


def chunk_layer_numbers(p: ParallelConfig, num_layers: int, pp_rank: int, chunk: int) -> range:
    """Global (0-based) layer numbers of stage pp_rank's virtual chunk `chunk`."""
    pp, v = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    if not 0 <= pp_rank < pp or not 0 <= chunk < v:
        raise ConfigError(f"stage {pp_rank} chunk {chunk} is outside a pipeline of {pp} x {v} chunks")
    counts = virtual_stage_layers(p, num_layers)
    start = sum(counts[:chunk * pp + pp_rank])
    return range(start, start + counts[chunk * pp + pp_rank])


def check_pipeline_layers(p: ParallelConfig, num_layers: int) -> None:
    """Megatron's checks of the split (module docstring): each kind's counts divide as it needs, one kind at a time."""
    pp, v = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    if is_uneven(p) or accounts_for_ends(p):
        if pp < 2:
            raise ConfigError(f"{FIRST_FLAG} / {LAST_FLAG} / {EMBEDDING_FLAG} / {LOSS_FLAG} need "
                              f"--pipeline-model-parallel-size > 1, got {pp}")
        if is_uneven(p) and accounts_for_ends(p):
            raise ConfigError(f"{FIRST_FLAG} / {LAST_FLAG} and {EMBEDDING_FLAG} / {LOSS_FLAG} are alternatives")
    if is_uneven(p):
        _check_uneven(p, num_layers)
        return
    counted = num_layers + p.account_for_embedding_in_pipeline_split + p.account_for_loss_in_pipeline_split
    if counted % (pp * v):
        what = (f"--num-layers {num_layers}" if counted == num_layers
                else f"--num-layers {num_layers} + the embedding / loss counted as layers ({counted})")
        raise ConfigError(f"{what} is not divisible by pipeline size {pp} x virtual size {v}"
                          + ("" if accounts_for_ends(p) else f" (give {FIRST_FLAG} / {LAST_FLAG} for uneven stages)"))


def _check_uneven(p: ParallelConfig, num_layers: int) -> None:
    """Counts >= 1 (limits.py), the middle layers divisible over the middle stages (none of either, or some of both),
    and under the interleaved schedule every stage's count divisible by v."""
    v = p.virtual_pipeline_model_parallel_size or 1
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
