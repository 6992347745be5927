"""Every parallel layout of a run on a given number of GPUs: the candidates `train-ledger search` ranks.

A layout is the base run (model, global batch size, sequence length, dtypes, overlap flags) with these chosen:
    tp   a divisor of the GPU count, at most the GPUs of one node (TP's collectives sit on every layer's critical
         path: across nodes they would run at network speed; Megatron's guidance, and every published large run)
    pp   a divisor of the GPUs left over, with a split of the layers over its stages:
           even        pp divides the layers
           ends        with pp > 1, the embedding and the loss counted as layers (Megatron-LM's
                       --account-for-embedding/loss-in-pipeline-split, Llama 3 405B's split): pp divides layers + 2;
                       not over two virtual stages (pp 2 without vpp), where each holds half the layers either way
    vpp  interleaving, with pp > 1 only: a divisor > 1 of the slots per stage (layers, or layers + 2 counting the ends)
         (None: 1F1B)
    dp   what is left: gpus / (tp x pp x cp)
    cp   not chosen: the base's --context-parallel-size (1 unless given; `train-ledger search` keeps 1) is held fixed,
         so tp and pp divide gpus / cp
    mbs  a divisor of the global batch's share per DP rank (gbs / dp)
    recompute none, selective, or full (uniform, 1 layer a group: Megatron's usual full setting)
    distributed optimizer on or off (off drops --overlap-param-gather, which needs it); with dp x cp = 1 the first
         choice alone (over one rank its shard is the whole state: the same layout twice)
    sequence parallel on or off, with tp > 1 only
Each candidate is then held to common.config.validate, the same checks a run's flags get (heads and query groups
divisible by tp, layers by pp x vpp, the global batch by mbs x dp, the interleaved schedule's micro-batch count a
multiple of pp, ...): the rules live there once, and a layout search can never propose a run `train` would refuse.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterator, Sequence

from common.config import RecomputeConfig, RunConfig, validate
from common.config.pipeline_layers import (
    EMBEDDING_FLAG,
    FIRST_FLAG,
    LAST_FLAG,
    LAYOUT_FLAG,
    LOSS_FLAG,
    SIZED_SPLIT_FIELDS,
)
from common.errors import ConfigError

RECOMPUTE_MODES = (RecomputeConfig(), RecomputeConfig("selective"), RecomputeConfig("full", "uniform", 1))
SPLITS = (False, True)  # the embedding and the loss counted as layers of the pipeline split (module docstring)
ENDS_FLAGS = (EMBEDDING_FLAG, LOSS_FLAG)  # one choice: both ends or neither


def divisors(n: int) -> list[int]:
    """n's divisors, ascending (pairs d, n / d up to the square root: a global batch of millions stays quick)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def enumerate_layouts(base: RunConfig, gpus: int, *, gpus_per_node: int,
                      recompute: Sequence[RecomputeConfig] = RECOMPUTE_MODES,
                      distributed_optimizer: Sequence[bool] = (False, True),
                      sequence_parallel: Sequence[bool] = (False, True),
                      rejected: Counter[str] | None = None) -> Iterator[RunConfig]:
    """Every valid layout of `base` on `gpus` GPUs (module docstring), in (tp, pp, vpp, mbs, recompute, distributed
    optimizer, sequence parallel) order. `rejected`, when given, counts the candidates validate refused, by the flag
    its message names first."""
    layers, gbs, cp = base.model.num_layers, base.train.global_batch_size, base.parallel.context_parallel_size
    for tp in (d for d in divisors(gpus // cp) if d <= gpus_per_node and gpus % cp == 0):
        for pp, ends in ((d, e) for d in divisors(gpus // (tp * cp)) for e in SPLITS
                         if (layers + 2 * e) % d == 0 and (d > 1 or not e)):
            dp = gpus // (tp * pp * cp)
            if gbs % dp:
                continue
            for vpp in [None] + ([v for v in divisors((layers + 2 * ends) // pp) if v > 1] if pp > 1 else []):
                if ends and pp * (vpp or 1) == 2:
                    continue  # two virtual stages: the ends split is the even split (a layout listed once)
                for mbs in divisors(gbs // dp):
                    for r in recompute:
                        for distributed in (distributed_optimizer if dp * cp > 1 else distributed_optimizer[:1]):
                            for sp in (sequence_parallel if tp > 1 else (False,)):
                                cfg = _layout(base, gpus, tp, pp, vpp, ends, mbs, r, distributed, sp)
                                try:
                                    validate(cfg)
                                except ConfigError as exc:
                                    if rejected is not None:
                                        rejected[str(exc).split(" ", 1)[0]] += 1
                                    continue
                                yield cfg


def _layout(base: RunConfig, gpus: int, tp: int, pp: int, vpp: int | None, ends: bool, mbs: int,
            recompute: RecomputeConfig, distributed: bool, sp: bool) -> RunConfig:
    parallel = dataclasses.replace(base.parallel, world_size=gpus, tensor_model_parallel_size=tp,
                                   pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                                   **dict.fromkeys(SIZED_SPLIT_FIELDS), account_for_embedding_in_pipeline_split=ends,
                                   account_for_loss_in_pipeline_split=ends, sequence_parallel=sp)
    train = dataclasses.replace(base.train, micro_batch_size=mbs, use_distributed_optimizer=distributed,
                                overlap_param_gather=base.train.overlap_param_gather and distributed)
    return dataclasses.replace(base, parallel=parallel, train=train, recompute=recompute)


def describe(cfg: RunConfig) -> dict[str, object]:
    """The knobs a layout chooses, by name, every one in every layout (what `search` prints and compares)."""
    p, t, r = cfg.parallel, cfg.train, cfg.recompute
    return {"tp": p.tensor_model_parallel_size, "cp": p.context_parallel_size, "pp": p.pipeline_model_parallel_size,
            "vpp": p.virtual_pipeline_model_parallel_size or 1,
            "ends_as_layers": p.account_for_embedding_in_pipeline_split, "dp": p.data_parallel_size,
            "mbs": t.micro_batch_size, "sp": p.sequence_parallel,
            "recompute": r.recompute_granularity or "none", "distributed_optimizer": t.use_distributed_optimizer}


def label(cfg: RunConfig) -> str:
    """One line, each choice named: "tp8 pp4 vpp2 dp32 mbs1, SP, recompute selective, distributed optimizer" (cp
    above 1 and "ends as layers", where the embedding and the loss count in the pipeline split, only where chosen)."""
    d = describe(cfg)
    sizes = " ".join([f"tp{d['tp']}", *([f"cp{d['cp']}"] if d["cp"] > 1 else []), f"pp{d['pp']}",
                      *([f"vpp{d['vpp']}"] if d["vpp"] > 1 else []), f"dp{d['dp']}", f"mbs{d['mbs']}"])
    return ", ".join([sizes, *(["ends as layers"] if d["ends_as_layers"] else []), *(["SP"] if d["sp"] else []),
                      f"recompute {d['recompute']}",
                      *(["distributed optimizer"] if d["distributed_optimizer"] else [])])


def layout_flags(cfg: RunConfig) -> list[str]:
    """The Megatron flags that make `cfg`'s layout choices, for a command line that reproduces it (search's hint to
    simulate its first layout); the world size is the caller's."""
    p, t, r = cfg.parallel, cfg.train, cfg.recompute
    flags = ["--tensor-model-parallel-size", str(p.tensor_model_parallel_size),
             "--pipeline-model-parallel-size", str(p.pipeline_model_parallel_size)]
    if p.context_parallel_size > 1:
        flags += ["--context-parallel-size", str(p.context_parallel_size)]
    if p.virtual_pipeline_model_parallel_size:
        flags += ["--virtual-pipeline-model-parallel-size", str(p.virtual_pipeline_model_parallel_size)]
    flags += list(ENDS_FLAGS) if p.account_for_embedding_in_pipeline_split else []
    flags += ["--micro-batch-size", str(t.micro_batch_size)]
    flags += ["--sequence-parallel"] if p.sequence_parallel else []
    flags += ["--use-distributed-optimizer"] if t.use_distributed_optimizer else []
    if r.recompute_granularity:
        flags += ["--recompute-granularity", r.recompute_granularity]
    if r.recompute_method:
        flags += ["--recompute-method", r.recompute_method, "--recompute-num-layers", str(r.recompute_num_layers)]
    return flags


_VALUED = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
           "--virtual-pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage", "--micro-batch-size",
           "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--world-size",
           FIRST_FLAG, LAST_FLAG, LAYOUT_FLAG)
_SWITCHES = ("--sequence-parallel", "--use-distributed-optimizer", *ENDS_FLAGS)


def with_layout(argv: Sequence[str], cfg: RunConfig) -> list[str]:
    """`argv` (a base run's Megatron flags) with `cfg`'s layout in place of whatever layout flags it held; without
    the distributed optimizer, --overlap-param-gather goes too (it needs it, as the enumeration drops it)."""
    switches = _SWITCHES + (() if cfg.train.use_distributed_optimizer else ("--overlap-param-gather",))
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _VALUED:
            skip = "=" not in arg
            continue
        if name not in switches:
            kept.append(arg)
    return kept + layout_flags(cfg)
