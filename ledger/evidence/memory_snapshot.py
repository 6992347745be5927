"""A torch.cuda.memory snapshot as Megatron-LM writes it (--record-memory-history: the last rank pickles
torch.cuda.memory._snapshot() to --memory-snapshot-path at each log interval), read as plain data and split at its
peak by Megatron-LM's allocation sites.

The file is a pickle, so it is never unpickled as such: the reader builds dicts, lists, strings and numbers and
refuses any other object (a snapshot holds nothing else). Its allocation trace is replayed (an alloc adds a block, a
free_requested removes it: the allocator's allocated-bytes count) to the largest moment, and each block live there is
put in a term of the peak by the frames that allocated it (docs/formulas.md, "Megatron-LM's memory snapshot").
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import InputError

# Terms, named as the peak formula's rows are (ledger/reconcile/memory_peak.py): by the frames of an allocation
STATIC = "static"  # the model's params, DDP's param and grad buffers, the optimizer's main params and Adam moments
GLOBAL_BUFFER = "megatrons_global_memory_buffer"  # GlobalMemoryBuffer.get_tensor (the unfused attention's scores)
LOGITS = "output_layer_logits"  # the output layer's 16-bit logits (GPTModel._postprocess)
BATCHES = "the_iterations_batches"  # get_batch's device copies, kept by the rerun data iterator
ACTIVATIONS = "saved_activations"  # the rest of a forward's tensors still live, the loss's fp32 softmax included
REST = "unattributed"  # allocated outside a forward and outside set-up (a backward's 16-bit weight grad, scalars)
STATIC_SITES = {"get_model", "get_megatron_optimizer", "_init_group"}
FORWARD_SITES = {"forward_step", "forward_step_calc_loss"}


@dataclass(frozen=True)
class PeakSplit:
    """The snapshot trace's largest moment: its live bytes, by term, and what allocated the block that set it."""
    path: Path
    peak: int
    terms: dict[str, int]
    set_by: str  # "file.py:function" of the innermost frame of the allocation that reached the peak
    events: int  # trace events replayed


class _PlainData(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}; a memory snapshot holds plain data only")


def read_snapshot(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = _PlainData(f).load()
    except OSError as exc:
        raise InputError(path, f"cannot read the memory snapshot: {exc.strerror or exc}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise InputError(path, f"not a memory snapshot this reader accepts ({exc or type(exc).__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("device_traces"), list):
        raise InputError(path, "not a torch.cuda.memory snapshot (no device_traces list)")
    return data


def term_of(frames: list[dict[str, Any]]) -> str:
    names = {f.get("name") for f in frames}
    if any(f.get("name") == "get_tensor" and str(f.get("filename", "")).endswith("utils.py") for f in frames):
        return GLOBAL_BUFFER
    if names & STATIC_SITES:
        return STATIC
    if "get_batch" in names:
        return BATCHES
    if names & FORWARD_SITES:
        postprocess = "_postprocess" in names and not any(
            str(f.get("filename", "")).endswith("cross_entropy.py") for f in frames)
        return LOGITS if postprocess else ACTIVATIONS
    return REST


def _site(frames: list[dict[str, Any]]) -> str:
    if not frames:
        return "no Python frame"
    f = frames[0]
    return f"{Path(str(f.get('filename', '?'))).name}:{f.get('name', '?')}"


def peak_split(path: Path) -> PeakSplit:
    """The device's allocation trace (the snapshot's first device with one) replayed to its largest moment."""
    data = read_snapshot(path)
    trace = next((t for t in data["device_traces"] if t), None)
    if trace is None:
        raise InputError(path, "the memory snapshot's allocation trace is empty (--record-memory-history off?)")
    at_peak = replay_to_peak(trace, path)
    terms = dict.fromkeys((STATIC, GLOBAL_BUFFER, BATCHES, ACTIVATIONS, LOGITS, REST), 0)
    for block in at_peak.live:
        terms[term_of(block.get("frames") or [])] += block["size"]
    return PeakSplit(path=path, peak=at_peak.peak, terms=terms, set_by=_site(at_peak.setter.get("frames") or []),
                     events=len(trace))


@dataclass(frozen=True)
class PeakMoment:
    """An allocation trace at its largest moment: the live bytes, the blocks live, the alloc that reached it."""
    peak: int
    live: list[dict[str, Any]]
    setter: dict[str, Any]
    index: int  # the setter's place in the trace


def replay_to_peak(trace: list[dict[str, Any]], path: Path) -> PeakMoment:
    """An alloc adds a block, a free_requested removes it (the allocator's allocated-bytes count); `path`, the
    snapshot's, names it in the error an event without its fields raises."""
    live: dict[int, dict[str, Any]] = {}
    current = 0
    best = PeakMoment(0, [], {}, 0)
    try:
        for i, e in enumerate(trace):
            if e["action"] == "alloc":
                live[e["addr"]] = e
                current += e["size"]
                if current > best.peak:
                    best = PeakMoment(current, list(live.values()), e, i)
            elif e["action"] == "free_requested" and e["addr"] in live:
                current -= live.pop(e["addr"])["size"]
    except (KeyError, TypeError) as exc:
        raise InputError(path, f"a memory snapshot trace event without {exc}") from None
    return best
