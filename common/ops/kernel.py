"""A catalogue entry (Kernel) and the records that group entries (OpGroup, Passes).

A Kernel is one call a rank runs, named after the engine's module and pass with Megatron Core's names
(linear_qkv.fprop, core_attention.bwd, rms_norm.fwd, ...), with the dims that set its cost and its FLOPs: a
calibration record matches it by (name, dims, dtype), so two calls of equal name and dims are one kernel. Its bytes
moved are traffic.py's, by name and dims, so that a record read back (which has no bytes) gets them too.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Kernel:
    name: str
    dims: tuple[tuple[str, int], ...]  # sorted (dim, size): the calibration's key
    flops: float = 0.0
    # The dims in the order the catalogue declares them, which the compute sweep's records keep (not compared).
    declared: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def describe(self) -> str:
        return f"{self.name}[{', '.join(f'{k}={v}' for k, v in self.dims)}]"

    def record_dims(self) -> dict[str, int]:
        """The dims as a compute record writes them: in declared order."""
        sizes = dict(self.dims)
        return {name: sizes[name] for name in self.declared or sizes}


def kernel(name: str, flops: float = 0.0, **dims: int) -> Kernel:
    return Kernel(name, tuple(sorted(dims.items())), flops, tuple(dims))


class OpGroup:
    """Mixed into a frozen dataclass whose fields are catalogue entries: kernels() is every Kernel among them (in
    nested groups and tuples too), in field order, each once. A group's list is its fields and nothing else, so
    what the time model reads from a group and what the compute sweep times of it cannot differ."""

    def kernels(self) -> tuple[Kernel, ...]:
        found: list[Kernel] = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            found += _entries(getattr(self, f.name))
        return tuple(dict.fromkeys(found))


def _entries(value: Any) -> list[Kernel]:
    if isinstance(value, Kernel):
        return [value]
    if isinstance(value, OpGroup):
        return list(value.kernels())
    if isinstance(value, tuple):
        return [k for v in value for k in _entries(v)]
    return []  # None (an op this rank does not run), sizes


@dataclass(frozen=True)
class Passes(OpGroup):
    """An op's forward and backward kernels."""
    fwd: Kernel
    bwd: Kernel

    def of(self, pass_: str) -> Kernel:
        return self.fwd if pass_ == "fwd" else self.bwd


def passes(name: str, flops: float = 0.0, backward_flops: float = 0.0, **dims: int) -> Passes:
    """`name`.fwd and `name`.bwd at the same dims."""
    return Passes(kernel(f"{name}.fwd", flops, **dims), kernel(f"{name}.bwd", backward_flops, **dims))
