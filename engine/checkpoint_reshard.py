"""Resharding: load a checkpoint saved at one parallel layout into a run at another (docs/engine.md, "Resharding").

A rank file (engine/checkpointing.py) is flat state cut by the layout that saved it: DDP param buffers with their
padding, and optimizer pieces (a parameter's elements inside the ranges a rank updates; under the distributed
optimizer, byte ranges of buckets that cut across parameter edges). Nothing in the file says which parameter an
element belongs to. That is recomputed here by the engine's own code, not by a second copy of its layout rules: the
saving rank's model chunks, DDP buffers and optimizer are built on the meta device (no memory, no values, no
communication) from the saved layout (layout.json), and read for each parameter's place in its buffer, each
optimizer piece and the order of torch's Adam state.

From the saved rank files this module then rebuilds, per parameter by its global name, the full tensor of each kind
of state (the value; where the optimizer is loaded, the fp32 main param when params are 16-bit, and Adam's m and v)
and cuts it as the loading rank holds it, into a state of the format the rank would have saved itself, which
Checkpointer._load restores as usual. Full tensors are rebuilt from the TP shards along each parameter's
partition_dim, honouring partition_stride (the fused SwiGLU fc1, stride 2), and cut again with the engine's
`partition`. The fused QKV weight needs nothing more: its rows are ordered by query group (attention.py), so a
contiguous TP split hands each rank whole query groups at any TP size. The vocab-parallel embedding and output layer
are padded to a multiple of divisible_by x TP; the padding rows (zero, and zero in m and v: the cross entropy masks
them, no token looks them up) are dropped or added as zeros. Layers keep their global numbers in names, so a change
of pipeline or virtual pipeline size regroups them; the last stage's copy of tied embeddings stands for the
embedding's weight (both copies apply the same updates). Experts (MoE) are named by their global index at any EP size
(engine/transformer/moe/experts.py), so a change of EP or of expert-DP regroups them alike: the saving ranks' expert
buffers are rebuilt on the expert grid (which experts a rank holds, the expert-DP group its buffers are padded and
sharded over), and the first rank of each expert-DP group is read for the expert values, as the first of each DP
group is for the dense ones.

What carries over unchanged: the iteration, the scheduler's step count and Adam's step. The data position is the
iteration's first micro-batch at the new layout: the sample order is global (engine/data.py micro_batch_samples).
RNG states are per rank and cannot be resharded: a rank takes the saved rank at its own (tp, cp, dp, pp) coordinates
where the saved grid has one, else fresh states from --seed, and rank 0 says in one line that the resume is then not
bit-exact. Nothing else is: model shape, precision, optimizer and global batch size are refused up front
(common.config.check_load_layout).
"""
from __future__ import annotations

import copy
import pickle
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from common.config import LAYOUT_DEFAULTS, RunConfig
from common.config.pipeline_layers import PIPELINE_SPLIT_FIELDS
from common.errors import InputError
from engine.model_builder import get_model
from engine.parallel_state import (
    AXES,
    LayoutGroup,
    ParallelState,
    RankGenerator,
    expert_rank_generator_for,
    rank_generator_for,
)
from engine.tensor_parallel.random import partition
from probes.probe_set import NullProbeSet

# The last pipeline stage's copy of tied embeddings (Megatron's `shared` weight) holds the embedding's values.
TIED_EMBEDDING = "embedding.weight"
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
OPTIMIZER_KINDS = ("main_param", "exp_avg", "exp_avg_sq")
RankFile = Callable[[int], Path]  # a saved rank's file in the checkpoint directory (engine.checkpointing names it)


@dataclass(frozen=True)
class _Placement:
    """A parameter in a rank's state: which param buffer (model chunks in order, each chunk's buffers in order),
    its first element there, and its local (this TP rank's) shape."""
    buffer: int
    start: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return torch.Size(self.shape).numel()


@dataclass(frozen=True)
class _Piece:
    """An optimizer piece: elements [start, end) of one flattened local parameter."""
    name: str
    start: int
    end: int


@dataclass
class RankLayout:
    """Where one rank keeps each parameter's state, by global name."""
    params: dict[str, _Placement]
    pieces: list[_Piece]  # in the order of optimizer.main_params (and of main_param_storage)
    adam_order: list[int]  # the piece of each index of torch's optimizer state_dict
    split: dict[str, tuple[int, int] | None]  # (partition_dim, partition_stride); None: TP-replicated


def global_name(chunk: Any, param: torch.nn.Parameter) -> str:
    """A chunk numbers its layers from 0; the name uses the layer's global number, so it is the same at any pipeline
    layout. The last stage's copy of tied embeddings is named as the embedding's weight."""
    if getattr(param, "shared", False):
        return TIED_EMBEDDING
    name = chunk.param_to_name[param]
    match = _LAYER.match(name)
    if match is None:
        return name
    return f"decoder.layers.{chunk.module.decoder.layers[int(match[1])].layer_number}.{match[2]}"


def describe(model: list[Any], optimizer: Any) -> RankLayout:
    """Read a rank's layout off its DDP chunks and optimizer (real ones, or built on the meta device)."""
    params: dict[str, _Placement] = {}
    split: dict[str, tuple[int, int] | None] = {}
    pieces: list[_Piece] = []
    buffers = [(chunk, buffer) for chunk in model for buffer in chunk.buffers]
    for index, (chunk, buffer) in enumerate(buffers):
        for param, (start, _) in buffer.param_index_map.items():
            name = global_name(chunk, param)
            params[name] = _Placement(index, start, tuple(param.shape))
            split[name] = ((param.partition_dim, param.partition_stride)
                           if getattr(param, "tensor_model_parallel", False) else None)
        # The optimizer's own enumeration, in the order its constructor made main_params.
        for param, lo, hi in optimizer._owned_pieces(buffer):
            start = buffer.param_index_map[param][0]
            pieces.append(_Piece(global_name(chunk, param), lo - start, hi - start))
    assert len(pieces) == len(optimizer.main_params), "pieces and main params disagree"
    piece_of = {id(main): i for i, main in enumerate(optimizer.main_params)}
    adam_order = [piece_of[id(p)] for group in optimizer.optimizer.param_groups for p in group["params"]]
    return RankLayout(params, pieces, adam_order, split)


def saved_run_config(cfg: RunConfig, saved: dict[str, Any]) -> RunConfig:
    """The saving run's configuration as far as its state's layout goes: this run's, with the keys that
    check_load_layout lets differ taken from layout.json."""
    out = copy.deepcopy(cfg)
    p, t = out.parallel, out.train
    p.world_size = saved["world_size"]
    p.tensor_model_parallel_size = saved["tensor_model_parallel_size"]
    p.pipeline_model_parallel_size = saved["pipeline_model_parallel_size"]
    p.context_parallel_size = saved["context_parallel_size"]
    p.virtual_pipeline_model_parallel_size = saved["virtual_pipeline_model_parallel_size"]
    for key in ("expert_model_parallel_size", *PIPELINE_SPLIT_FIELDS):  # absent from layouts saved before them
        setattr(p, key, saved.get(key, LAYOUT_DEFAULTS[key]))
    t.overlap_grad_reduce, t.ddp_bucket_size = saved["overlap_grad_reduce"], saved["ddp_bucket_size"]
    t.micro_batch_size = saved["micro_batch_size"]
    t.overlap_param_gather = False  # when the all-gather runs changes nothing of where state sits
    return out


def _grid(cfg: RunConfig) -> RankGenerator:
    p = cfg.parallel
    return rank_generator_for(p.world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                              p.context_parallel_size, p.order)


def _expert_grid(cfg: RunConfig) -> RankGenerator:
    p = cfg.parallel
    return expert_rank_generator_for(p.world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                     p.expert_model_parallel_size, p.order)


def _layout_group(grid: RankGenerator, token: str, rank: int) -> LayoutGroup:
    (group,) = [g for g in grid.get_ranks(token) if rank in g]
    return LayoutGroup(len(group), group.index(rank))


def _layout_parallel_state(cfg: RunConfig, rank: int) -> ParallelState:
    """Rank `rank` of cfg's grid, with layout-only groups (a tied embedding's all-reduce on the meta device is
    dispatched to no backend, so it gets the default group). An MoE model also gets its place on the expert grid:
    which experts it holds (ep) and the expert-DP group its expert buffers are padded and sharded over."""
    grid = _grid(cfg)
    c = grid.coordinates(rank)
    groups = {"dp_cp": _layout_group(grid, "dp-cp", rank), "tp": None, "embedding": None}
    expert = {}
    if cfg.model.is_moe:
        experts = _expert_grid(cfg)
        groups.update(ep=_layout_group(experts, "ep", rank), expt_dp=_layout_group(experts, "dp", rank))
        expert = dict(ep_size=experts.sizes["ep"], ep_rank=experts.coordinates(rank)["ep"],
                      expert_dp_size=experts.sizes["dp"])
    return ParallelState(rank=rank, world_size=grid.world_size, tp_size=grid.sizes["tp"],
                         pp_size=grid.sizes["pp"], dp_size=grid.sizes["dp"], cp_size=grid.sizes["cp"],
                         tp_rank=c["tp"], pp_rank=c["pp"], dp_rank=c["dp"], cp_rank=c["cp"], groups=groups,
                         virtual_pipeline_size=cfg.parallel.virtual_pipeline_model_parallel_size, **expert)


def _first_replica(state: ParallelState) -> bool:
    """Whether this saving rank's values are read: the first of its DP group holds every dense parameter of its
    stage, but an MoE model's experts differ between EP ranks, so the first of each expert-DP group is read too."""
    return any(state.groups[kind].rank() == 0 for kind in ("dp_cp", "expt_dp") if kind in state.groups)


def saved_rank_layout(saved_cfg: RunConfig, rank: int) -> RankLayout:
    """The layout of the saving run's rank `rank`, from its model, DDP and optimizer built on the meta device."""
    from engine.optimizer import get_megatron_optimizer

    parallel_state = _layout_parallel_state(saved_cfg, rank)
    model = get_model(saved_cfg, parallel_state, torch.device("meta"), NullProbeSet())
    return describe(model, get_megatron_optimizer(saved_cfg.train, model, parallel_state))


def unpartition(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The full tensor from TP shards by rank: the inverse of engine.tensor_parallel.random.partition."""
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


def _fit_rows(full: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """Vocabulary padding differs with the TP size: drop padding rows (which must be zero) or add zero rows."""
    if full.shape[0] == rows:
        return full
    if full.shape[0] > rows:
        assert not full[rows:].any(), f"{name}: rows beyond {rows} are not padding"
        return full[:rows]
    return torch.cat((full, full.new_zeros((rows - full.shape[0], *full.shape[1:]))))


@dataclass
class _SavedShards:
    """Flat local shards of the saved state (kind -> global name -> saved TP rank -> tensor), each parameter's local
    shape at the saved layout, and Adam's step."""
    tp_size: int
    shards: dict[str, dict[str, dict[int, torch.Tensor]]] = field(
        default_factory=lambda: {kind: {} for kind in ("param", *OPTIMIZER_KINDS)})
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    adam_step: torch.Tensor | None = None

    def put(self, kind: str, name: str, tp_rank: int, numel: int, piece: _Piece | None,
            value: torch.Tensor) -> None:
        if piece is None:
            self.shards[kind].setdefault(name, {})[tp_rank] = value.reshape(-1)
            return
        flat = self.shards[kind].setdefault(name, {}).setdefault(tp_rank, torch.zeros(numel, dtype=value.dtype))
        flat[piece.start:piece.end] = value

    def full(self, kind: str, name: str, split: tuple[int, int] | None) -> torch.Tensor:
        """The full tensor of `name` (split None: TP-replicated, TP rank 0's copy)."""
        by_rank = self.shards[kind][name]
        if split is None:
            return by_rank[0].view(self.shapes[name])
        assert sorted(by_rank) == list(range(self.tp_size)), f"{name}: {kind} of TP ranks {sorted(by_rank)} only"
        return unpartition([by_rank[r].view(self.shapes[name]) for r in range(self.tp_size)], *split)


def _read_saved(rank_file: RankFile, saved_cfg: RunConfig, needed: set[str], with_optimizer: bool) -> tuple[
        _SavedShards, dict[str, Any]]:
    """The saved shards of the `needed` names, and one saved rank file's scalars (iteration, scheduler)."""
    grid = _grid(saved_cfg)
    sharded = saved_cfg.train.use_distributed_optimizer
    out, scalars = _SavedShards(grid.sizes["tp"]), {}
    for rank in range(grid.world_size):
        first_replica = _first_replica(_layout_parallel_state(saved_cfg, rank))
        if not (first_replica or (with_optimizer and sharded)):
            continue  # replicas hold the same values
        layout = saved_rank_layout(saved_cfg, rank)
        if not needed & layout.params.keys():
            continue
        state = _load_rank(rank_file, rank)
        scalars = scalars or {k: state[k] for k in ("iteration", "scheduler_num_steps")}
        tp_rank = grid.coordinates(rank)["tp"]
        if first_replica:
            for name in needed & layout.params.keys():
                place = layout.params[name]
                out.shapes[name] = place.shape
                value = state["param_buffers"][place.buffer][place.start:place.start + place.numel]
                out.put("param", name, tp_rank, place.numel, None, value)
        if with_optimizer:
            _read_optimizer(state, layout, needed, tp_rank, out)
    return out, scalars


def _load_rank(rank_file: RankFile, rank: int) -> dict[str, Any]:
    """A saved rank's file, memory-mapped: only the slices read are paged in."""
    return load_rank_file(rank_file(rank), mmap=True)


def load_rank_file(path: Path, mmap: bool = False) -> dict[str, Any]:
    """One rank's saved state, or InputError naming the file: torch.load's own errors for a truncated or corrupt file
    (a zip reader's internals, or advice to load with weights_only=False, which would run arbitrary code) are not
    the user's to read."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except OSError as exc:
        raise InputError(path, f"cannot be read ({exc.strerror or exc})") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError):
        raise InputError(path, "is not a whole checkpoint file (truncated or corrupt; it loads only as torch.save "
                               "wrote it)") from None
    if not isinstance(state, dict) or "param_buffers" not in state:
        raise InputError(path, "does not hold a rank's training state (no param_buffers)")
    return state


def _read_optimizer(state: dict[str, Any], layout: RankLayout, needed: set[str], tp_rank: int,
                    out: _SavedShards) -> None:
    storage = state["main_param_storage"]
    offsets = [0]
    for piece in layout.pieces:
        offsets.append(offsets[-1] + piece.end - piece.start)
    adam = state["adam"]["state"]
    for index, piece_index in enumerate(layout.adam_order):
        piece = layout.pieces[piece_index]
        if piece.name not in needed:
            continue
        numel = layout.params[piece.name].numel
        if storage is not None:  # 16-bit params: the fp32 main params are views into one storage, in piece order
            main = storage[offsets[piece_index]:offsets[piece_index + 1]]
            out.put("main_param", piece.name, tp_rank, numel, piece, main)
        if index in adam:
            out.adam_step = adam[index]["step"]
            for kind in ("exp_avg", "exp_avg_sq"):
                out.put(kind, piece.name, tp_rank, numel, piece, adam[index][kind])


@dataclass
class _Target:
    """One parameter as the loading rank holds it."""
    place: _Placement
    split: tuple[int, int] | None
    tp_rank: int
    tp_size: int

    def cut(self, full: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's flat local shard of `full` (a vocab-parallel full tensor first fitted to this TP's padding)."""
        if self.split is None:
            return full.reshape(-1)
        dim, stride = self.split
        full_shape = list(self.place.shape)
        full_shape[dim] *= self.tp_size
        if dim == 0:
            full = _fit_rows(full, full_shape[0], name)
        assert list(full.shape) == full_shape, f"{name}: saved {tuple(full.shape)}, this run {tuple(full_shape)}"
        return partition(full, dim, stride, self.tp_rank, self.tp_size).reshape(-1)


def _rng_for(cfg: RunConfig, saved_cfg: RunConfig, rank_file: RankFile, rank: int) -> dict[str, Any] | None:
    """The saved RNG states of the saved rank at this rank's coordinates; None where the saved grid has none."""
    saved_rank = _same_coordinates(_grid(saved_cfg), _grid(cfg).coordinates(rank))
    if saved_rank is None:
        return None
    return _load_rank(rank_file, saved_rank)["rng"]


def _same_coordinates(saved: RankGenerator, coords: dict[str, int]) -> int | None:
    if any(coords[axis] >= saved.sizes[axis] for axis in AXES):
        return None
    return sum(coords[axis] * saved.strides[axis] for axis in AXES)


def _fresh_rng(seed: int) -> dict[str, Any]:
    """RNG states as a fresh run with --seed starts them (engine.train seeds torch; the CUDA state is left as is)."""
    return {"torch": torch.Generator().manual_seed(seed).get_state(), "python": random.Random(seed).getstate(),
            "cuda": None}


def resharding_note(cfg: RunConfig, saved_layout: dict[str, Any], name: str) -> str:
    """rank 0's one line: from which layout to which, and whether every rank found its saved RNG states."""
    saved_cfg = saved_run_config(cfg, saved_layout)

    def where(c: RunConfig) -> str:
        g = _grid(c)
        vpp = c.parallel.virtual_pipeline_model_parallel_size
        ep = c.parallel.expert_model_parallel_size
        return (f"tp {g.sizes['tp']} pp {g.sizes['pp']} dp {g.sizes['dp']}" + (f" vpp {vpp}" if vpp else "")
                + (f" ep {ep} expt_dp {_expert_grid(c).sizes['dp']}" if c.model.is_moe else "")
                + f" (micro-batch {c.train.micro_batch_size})")
    grid, saved = _grid(cfg), _grid(saved_cfg)
    fresh = [r for r in range(grid.world_size) if _same_coordinates(saved, grid.coordinates(r)) is None]
    note = f"train-ledger: resharding {name} saved at {where(saved_cfg)} to {where(cfg)}"
    if fresh:
        note += (f"; ranks {fresh} have no saved rank at their coordinates and start their RNG states fresh from "
                 "--seed: the resume is not bit-exact")
    return note


def resharded_state(cfg: RunConfig, saved_layout: dict[str, Any], rank_file: RankFile, model: list[Any],
                    optimizer: Any, *, with_optimizer: bool) -> dict[str, Any]:
    """This rank's state, in the format of its own rank file, rebuilt from a checkpoint saved at another layout.
    with_optimizer False (--finetune, --no-load-optim) leaves "main_param_storage" and "adam" None."""
    saved_cfg = saved_run_config(cfg, saved_layout)
    mine = describe(model, optimizer)
    rank = dist.get_rank()
    coords = _grid(cfg).coordinates(rank)
    saved, scalars = _read_saved(rank_file, saved_cfg, set(mine.params), with_optimizer)
    targets = {name: _Target(place, mine.split[name], coords["tp"], _grid(cfg).sizes["tp"])
               for name, place in mine.params.items()}

    def local(kind: str, name: str) -> torch.Tensor:
        return targets[name].cut(saved.full(kind, name, mine.split[name]), name)

    buffers = [buffer.param_data for chunk in model for buffer in chunk.buffers]
    param_buffers = [torch.zeros(b.shape, dtype=b.dtype) for b in buffers]
    for name, place in mine.params.items():
        param_buffers[place.buffer][place.start:place.start + place.numel] = local("param", name)
    state: dict[str, Any] = {
        "iteration": scalars["iteration"], "param_buffers": param_buffers, "main_param_storage": None, "adam": None,
        "scheduler_num_steps": scalars["scheduler_num_steps"],
        "rng": _rng_for(cfg, saved_cfg, rank_file, rank) or _fresh_rng(cfg.train.seed),
        "data_positions": [scalars["iteration"] * cfg.num_microbatches] * len(model)}
    if with_optimizer:
        state["main_param_storage"], state["adam"] = _optimizer_state(mine, optimizer, saved, local)
    return state


def _optimizer_state(mine: RankLayout, optimizer: Any, saved: _SavedShards,
                     local: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """main_param_storage (16-bit params only) and torch's Adam state_dict, for this rank's pieces."""
    names = {piece.name for piece in mine.pieces}
    cut = {kind: {name: local(kind, name) for name in names if name in saved.shards[kind]}
           for kind in OPTIMIZER_KINDS}
    storage = None
    if optimizer.main_param_storage is not None:
        storage = torch.cat([cut["main_param"][p.name][p.start:p.end] for p in mine.pieces])
    adam_state = {}
    if saved.adam_step is not None:
        for index, piece_index in enumerate(mine.adam_order):
            p = mine.pieces[piece_index]
            adam_state[index] = {"step": saved.adam_step.clone(),  # one tensor per param: Adam increments each
                                 "exp_avg": cut["exp_avg"][p.name][p.start:p.end].clone(),
                                 "exp_avg_sq": cut["exp_avg_sq"][p.name][p.start:p.end].clone()}
    return storage, {"state": adam_state, "param_groups": optimizer.optimizer.state_dict()["param_groups"]}
