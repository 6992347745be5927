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
    this: one layer a chunk, the first chunk the embedding alone, the last the output layer and loss alone;
  * spelled out (--pipeline-model-parallel-layout, Megatron's string): one "|"-separated entry per virtual stage, in
    virtual-stage order, E the embedding, t a decoder layer, L the loss; "(...)*n" and "x*n" repeat, commas are
    cosmetic. "Et*3|(tt|)*6,tL" over pp 4: v = 8 / 4 = 2, virtual stages of 3, 2 x 6 and 1 layers. The count of
    virtual stages over pp gives v.
"""
from __future__ import annotations

import re

from common.config.parallel_config import ParallelConfig
from common.errors import ConfigError

FIRST_FLAG, LAST_FLAG = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG, LOSS_FLAG = "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"
LAYOUT_FLAG = "--pipeline-model-parallel-layout"
# The ParallelConfig fields that decide which layers each stage holds, beyond the sizes.
PIPELINE_SPLIT_FIELDS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                         "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                         "pipeline_model_parallel_layout")
# Those written for one pipeline size (a stage's own count, a spelled-out layout): a layout of another size drops
# them (search, what-if); counting the ends as layers applies at any size.
SIZED_SPLIT_FIELDS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                      "pipeline_model_parallel_layout")
MAX_LAYOUT_CHARS = 100_000  # unrolled: ten times the most layers a config may have, the ends and separators aside
_REPEATS = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))  # Megatron's: "(ab|)*n", then "x*n"


def layout_stages(layout: str) -> tuple[str, ...]:
    """Megatron's layout string unrolled, one string of E / t / L per virtual stage (module docstring)."""
    text = layout.replace(",", "")
    for pattern in _REPEATS:
        text = pattern.sub(lambda m: _repeat(m[1], int(m[2])), text)
    if len(text) > MAX_LAYOUT_CHARS:
        raise ConfigError(f"{LAYOUT_FLAG}: {len(text):,} characters unrolled, beyond the longest layout supported "
                          f"({MAX_LAYOUT_CHARS:,})")
    unknown = sorted(set(text) - set("EtL|"))
    if unknown:
        what = ("m (multi-token prediction layers are not built)" if unknown == ["m"]
                else f"{''.join(unknown)!r} (known: E, t, L, |, (...)*n, x*n)")
        raise ConfigError(f"{LAYOUT_FLAG} {layout!r}: {what}")
    return tuple(text.split("|"))


def _repeat(unit: str, times: int) -> str:
    if len(unit) * times > MAX_LAYOUT_CHARS:
        raise ConfigError(f"{LAYOUT_FLAG}: {unit!r} x {times:,} is beyond the longest layout supported "
                          f"({MAX_LAYOUT_CHARS:,} characters)")
    return unit * times


def is_uneven(p: ParallelConfig) -> bool:
    return p.decoder_first_pipeline_num_layers is not None or p.decoder_last_pipeline_num_layers is not None


def accounts_for_ends(p: ParallelConfig) -> bool:
    return p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split


def split_kinds(p: ParallelConfig) -> list[str]:
    """The split flags given, by kind: at most one kind may be."""
    return [flags for flags, given in ((f"{FIRST_FLAG} / {LAST_FLAG}", is_uneven(p)),
                                       (f"{EMBEDDING_FLAG} / {LOSS_FLAG}", accounts_for_ends(p)),
                                       (LAYOUT_FLAG, p.pipeline_model_parallel_layout is not None)) if given]


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
    if p.pipeline_model_parallel_layout is not None:
        return tuple(stage.count("t") for stage in layout_stages(p.pipeline_model_parallel_layout))
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
    kinds = split_kinds(p)
    if kinds and pp < 2:
        raise ConfigError(f"{kinds[0]}: only with --pipeline-model-parallel-size > 1, got {pp}")
    if len(kinds) > 1:
        raise ConfigError(f"{' and '.join(kinds)} are alternatives: give one")
    if p.pipeline_model_parallel_layout is not None:
        _check_layout(p, num_layers)
        return
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


def _check_layout(p: ParallelConfig, num_layers: int) -> None:
    """Megatron's checks of a spelled-out layout: whole rounds of pp virtual stages (v of them a stage, as
    --virtual-pipeline-model-parallel-size says if given), the embedding first and the loss last, each once, and
    every decoder layer once."""
    layout, pp = p.pipeline_model_parallel_layout, p.pipeline_model_parallel_size
    stages = layout_stages(layout)
    if len(stages) % pp or len(stages) // pp != (p.virtual_pipeline_model_parallel_size or 1):
        raise ConfigError(f"{LAYOUT_FLAG} {layout!r} has {len(stages)} virtual stage(s): not "
                          f"{p.virtual_pipeline_model_parallel_size or 1} for each of {pp} pipeline stages")
    text = "".join(stages)
    if text.count("E") != 1 or not text.startswith("E") or text.count("L") != 1 or not text.endswith("L"):
        raise ConfigError(f"{LAYOUT_FLAG} {layout!r}: the embedding (E) must open the first virtual stage and the "
                          "loss (L) close the last, each once")
    if text.count("t") != num_layers:
        raise ConfigError(f"{LAYOUT_FLAG} {layout!r} places {text.count('t')} decoder layer(s) (t), not "
                          f"--num-layers {num_layers}")
