"""A GPU kind as the simulator sees it: a small, versioned JSON file in ledger/models/hardware/ (one per kind) read into
a frozen `Hardware`.

Every number in a file carries its provenance: a scalar is `{"value": x, "source": "..."}`, a fitted block (a curve,
a table) has its own "source". For the H200 and the H100 the sources are our own calibration sweeps
(runs/bench/hardware_fit.py fits them from grid sweeps of kernels on that GPU); for the A100s public datasheets, and,
where no datasheet speaks (achieved efficiencies), a labelled assumption. The cost model the fields feed is
ledger/models/simulate/kernel_cost.py (kernels) and ledger/models/simulate/topology.py (collectives); docs there.

    load_hardware("H200")           a known kind, case-insensitive: H200, H100, A100-80GB, A100-40GB
    load_hardware("path/to/x.json") a file of the same schema

A malformed file, an unknown name, a missing field, a field without its source or a non-positive value (a fixed
cost may be zero) raises common.errors.ConfigError with one line naming the problem (and the file); the CLI turns it
into exit status 2.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

from common.errors import ConfigError
from common.ops.host import GRAPH_PRIMITIVES, HOST_PRIMITIVES
from common.rank_info import RankInfo
from ledger.models.formulas.device_memory import DeviceOverheads
from ledger.models.time_model.host_costs import HostCosts

HARDWARE_DIR = Path(__file__).resolve().parent.parent / "hardware"
SCHEMA_VERSION = 1
KNOWN = {"H200": "h200.json", "H100": "h100.json", "A100-80GB": "a100-80gb.json", "A100-40GB": "a100-40gb.json"}
WORKSPACES = "allocator_workspaces"  # optional: cuBLAS / cuBLASLt workspaces inside PyTorch's allocator
OVERHEAD_TERMS = ("driver_reserved", "cuda_context", "nccl_first_communicator", "nccl_communicator",
                  "library_modules")


@dataclass(frozen=True)
class Curve:
    """Piecewise linear in log2(x) through (x, y) points, constant beyond the first and last point."""
    points: tuple[tuple[float, float], ...]

    def at(self, x: float) -> float:
        xs = [p[0] for p in self.points]
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return self.points[0][1]
        if i == len(xs):
            return self.points[-1][1]
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        w = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
        return y0 + w * (y1 - y0)


@dataclass(frozen=True)
class GemmCost:
    """seconds = fixed_s + flops / (peak x compute_efficiency) + output bytes / (HBM bandwidth x epilogue_efficiency)
    (kernel_cost.gemm_seconds derives the output bytes)."""
    fixed_s: float
    compute_efficiency: float
    epilogue_efficiency: float
    # A grouped GEMM (torch._grouped_mm, --moe-grouped-gemm) over the dense GEMM of its total shape, measured side by
    # side (the file's optional "grouped_gemm" block); 1 where a file has no measurement.
    grouped_slowdown: float = 1.0


@dataclass(frozen=True)
class AttentionCost:
    """Flash attention's efficiency (fraction of the dense peak) per pass and head dim, by sequence length and by
    batch x heads (the kernel's independent (sequence, head) problems: few of them leave SMs idle, which at TP 8 of a
    large model, 4 to 12 local heads, costs a factor of two). Measured seqs each carry a curve over batch x heads;
    between two seqs the efficiency is linear in log2(seq), outside them the nearest seq's; between two head dims
    linear in the head dim, outside them the nearest one's."""
    fwd: tuple[tuple[int, tuple[tuple[int, Curve], ...]], ...]  # (head_dim, ((seq, efficiency by batch x heads)))
    bwd: tuple[tuple[int, tuple[tuple[int, Curve], ...]], ...]

    @staticmethod
    def _between(points: tuple[tuple[int, Any], ...], x: float, at, log: bool) -> float:
        keys = [k for k, _ in points]
        i = bisect.bisect_left(keys, x)
        if i < len(keys) and keys[i] == x or i == 0:
            return at(points[min(i, len(keys) - 1)][1])
        if i == len(keys):
            return at(points[-1][1])
        (k0, v0), (k1, v1) = points[i - 1], points[i]
        w = (math.log2(x / k0) / math.log2(k1 / k0)) if log else (x - k0) / (k1 - k0)
        return at(v0) + w * (at(v1) - at(v0))

    def efficiency(self, pass_: str, head_dim: int, seq: int, batch_heads: int) -> float:
        by_dim = self.fwd if pass_ == "fwd" else self.bwd
        return self._between(by_dim, head_dim, lambda by_seq: self._between(
            by_seq, seq, lambda curve: curve.at(batch_heads), log=True), log=False)


@dataclass(frozen=True)
class MemoryCost:
    """seconds = fixed + bytes moved / (HBM bandwidth x efficiency of the kernel's name, else default); fixed is
    fixed_s but for a chain of kernels fitted with its own (an MoE routing pass)."""
    fixed_s: float
    default_efficiency: float
    kernels: tuple[tuple[str, float], ...]  # name -> efficiency (fraction of HBM bandwidth)
    fixed_by_kernel: tuple[tuple[str, float], ...] = ()  # name -> its own fixed seconds

    @cached_property
    def _fixed(self) -> dict[str, float]:
        return dict(self.fixed_by_kernel)

    @cached_property
    def _efficiency(self) -> dict[str, float]:
        return dict(self.kernels)

    def fixed(self, name: str) -> float:
        return self._fixed.get(name, self.fixed_s)

    def efficiency(self, name: str, proxy: str | None = None) -> float:
        """The kernel's own efficiency, else its proxy's (a kernel of the same access pattern), else the default."""
        return self._efficiency.get(name, self._efficiency.get(proxy or "", self.default_efficiency))


@dataclass(frozen=True)
class Sustained:
    """Slowdown of compute-bound kernels under sustained load (power limit): 1 + slope x (e - threshold), at least 1,
    where e is a layer's isolated GEMM and attention efficiency (its FLOPs over peak x its kernels' isolated time);
    `threshold_share`: the share of a step's wall time compute-bound kernels fill below which the GPU stays under its
    limit (the "power_limit" block; None where the file has none: the full slowdown in every step)."""
    threshold_efficiency: float
    slope: float
    threshold_share: float | None = None

    def factor(self, layer_efficiency: float) -> float:
        return max(1.0, 1.0 + self.slope * (layer_efficiency - self.threshold_efficiency))


@dataclass(frozen=True)
class Protocol:
    """NCCL's latency model for one protocol: a base latency per collective and a latency per ring step over each
    kind of link; `bandwidth_fraction` of the link's bus bandwidth it reaches."""
    base_s: float
    intra_hop_s: float
    inter_hop_s: float
    bandwidth_fraction: float


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    version: str
    peak_flops: tuple[tuple[str, float], ...]  # dtype -> dense FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    gpus_per_node: int
    gemm: GemmCost
    attention: AttentionCost
    memory: MemoryCost
    sustained: Sustained
    nvlink_bus_bandwidth: float  # bytes/s, a collective's bus bandwidth inside a node
    nvlink_p2p_bandwidth: float  # bytes/s, one send/recv between two GPUs of a node
    nic_bandwidth: float  # bytes/s per GPU, line rate
    nic_efficiency: float  # fraction of the line rate a collective's bus bandwidth reaches across nodes
    protocols: tuple[tuple[str, Protocol], ...]  # "ll" (small messages), "simple" (large)
    overheads: DeviceOverheads  # memory outside PyTorch (ledger/models/formulas/device_memory.py)
    path: str
    host: HostCosts | None = None  # the host timeline's prices on the machine the file was measured on (optional)

    def __hash__(self) -> int:
        """Cheap: the kernel-time memo (calibration.py) hashes a Hardware per lookup; equality compares every field."""
        return hash((self.name, self.version, self.path))

    def peak(self, dtype: str) -> float:
        found = dict(self.peak_flops).get(dtype)
        if found is None:
            raise ConfigError(f"{self.path}: no peak FLOP/s for dtype {dtype!r} "
                              f"(has {', '.join(d for d, _ in self.peak_flops)})")
        return found


def known_names() -> list[str]:
    """The GPU kinds with a file in ledger/models/hardware/, as `load_hardware` accepts them (any case)."""
    return list(KNOWN)


def hardware_file(name: str) -> Path | None:
    """The file of a known GPU kind (any case), None for any other name."""
    known = {kind.lower(): file for kind, file in KNOWN.items()}.get(name.strip().lower())
    return HARDWARE_DIR / known if known is not None else None


def write_hardware_json(path: Path, data: dict[str, Any]) -> None:
    """A hardware file written back as the fitting scripts keep them: one-space indent, a final newline."""
    path.write_text(json.dumps(data, indent=1) + "\n")


def _path_of(spec: str) -> Path:
    """A known name (any case) or a file path; anything else is an unknown name."""
    known = hardware_file(spec)
    if known is not None:
        return known
    path = Path(spec)
    if path.suffix.lower() == ".json" or path.exists():
        if not path.is_file():
            raise ConfigError(f"hardware file {spec} {'is not a file' if path.exists() else 'does not exist'}")
        return path
    raise ConfigError(f"unknown hardware {spec!r}: one of {', '.join(known_names())}, or a .json file")


class _Reader:
    """Field access that names the file and the field in every error."""

    def __init__(self, path: Path, data: Any):
        self.path, self.data = path, data

    def fail(self, field: str, problem: str) -> ConfigError:
        return ConfigError(f"hardware file {self.path}: {field} {problem}")

    def node(self, field: str, parent: Any = None, within: str = "") -> Any:
        """`field` (dotted) of the file's root, or of `parent`, the block named `within`."""
        obj = self.data if parent is None else parent
        for part in field.split("."):
            if not isinstance(obj, dict) or part not in obj:
                raise self.fail(within + field, "is missing")
            obj = obj[part]
        return obj

    def sourced(self, field: str) -> Any:
        """A block that must carry a non-empty "source"."""
        obj = self.node(field)
        if not isinstance(obj, dict):
            raise self.fail(field, "must be an object")
        if not isinstance(obj.get("source"), str) or not obj["source"].strip():
            raise self.fail(field, "has no source (every number says where it comes from)")
        return obj

    def number(self, field: str, *, integer: bool = False, at_most: float | None = None) -> float:
        obj = self.sourced(field)
        if "value" not in obj:
            raise self.fail(field, "has no value")
        return self.check(field, obj["value"], integer=integer, at_most=at_most)

    def check(self, field: str, value: Any, *, integer: bool = False, at_most: float | None = None,
              zero: bool = False) -> float:
        """A finite number, positive (`zero`: or zero, for a fixed cost a fit found none of)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(field, f"must be a number, got {value!r}")
        if integer and value != int(value):
            raise self.fail(field, f"must be an integer, got {value!r}")
        if value < 0 or value == 0 and not zero:
            raise self.fail(field, f"must be {'non-negative' if zero else 'positive'}, got {value!r}")
        if at_most is not None and value > at_most:
            raise self.fail(field, f"must be at most {at_most}, got {value!r}")
        return int(value) if integer else float(value)

    def inner(self, block: str, key: str, **check: Any) -> float:
        """A number `key` of the sourced block `block` (the block's source covers it)."""
        return self.check(f"{block}.{key}", self.node(key, self.sourced(block), block + "."), **check)

    def curve(self, field: str, points: Any) -> Curve:
        if not isinstance(points, list) or not points:
            raise self.fail(field, "must be a non-empty list of [x, y] points")
        pts = []
        for p in points:
            if not isinstance(p, list) or len(p) != 2:
                raise self.fail(field, f"point {p!r} is not [x, y]")
            pts.append((self.check(field, p[0]), self.check(field, p[1], at_most=1.0)))
        xs = [x for x, _ in pts]
        if xs != sorted(xs) or len(set(xs)) != len(xs):
            raise self.fail(field, "points must have strictly increasing x")
        return Curve(tuple(pts))


def _attention(r: _Reader, pass_: str) -> tuple[tuple[int, tuple[tuple[int, Curve], ...]], ...]:
    field = f"attention.{pass_}.by_head_dim"
    by_dim = r.node(f"{pass_}.by_head_dim", r.sourced("attention"), "attention.")
    if not isinstance(by_dim, dict) or not by_dim:
        raise r.fail(field, "must map head dims to {seq: [[batch x heads, efficiency], ...]}")
    out = []
    for dim, by_seq in by_dim.items():
        if not dim.isdigit() or int(dim) < 1:
            raise r.fail(field, f"key {dim!r} is not a positive head dim")
        if not isinstance(by_seq, dict) or not by_seq:
            raise r.fail(f"{field}.{dim}", "must map sequence lengths to [[batch x heads, efficiency], ...]")
        curves = []
        for seq, points in by_seq.items():
            if not seq.isdigit() or int(seq) < 1:
                raise r.fail(f"{field}.{dim}", f"key {seq!r} is not a positive sequence length")
            curves.append((int(seq), r.curve(f"{field}.{dim}.{seq}", points)))
        out.append((int(dim), tuple(sorted(curves))))
    return tuple(sorted(out))


def _memory(r: _Reader) -> MemoryCost:
    kernels = r.node("efficiency_by_kernel", r.sourced("memory_bound"), "memory_bound.")
    if not isinstance(kernels, dict):
        raise r.fail("memory_bound.efficiency_by_kernel", "must map kernel names to efficiencies")
    fixed = r.sourced("memory_bound").get("fixed_s_by_kernel", {})
    if not isinstance(fixed, dict):
        raise r.fail("memory_bound.fixed_s_by_kernel", "must map kernel names to seconds")
    return MemoryCost(
        fixed_s=r.inner("memory_bound", "fixed_s", zero=True),
        default_efficiency=r.inner("memory_bound", "default_efficiency", at_most=1.0),
        kernels=tuple(sorted((name, r.check(f"memory_bound.efficiency_by_kernel.{name}", e, at_most=1.0))
                             for name, e in kernels.items())),
        fixed_by_kernel=tuple(sorted((name, r.check(f"memory_bound.fixed_s_by_kernel.{name}", s, zero=True))
                                     for name, s in fixed.items())))


def _protocols(r: _Reader) -> tuple[tuple[str, Protocol], ...]:
    block = r.sourced("nccl_protocols")
    out = []
    for name in ("ll", "simple"):
        p = r.node(name, block, "nccl_protocols.")
        out.append((name, Protocol(*(r.check(f"nccl_protocols.{name}.{k}", r.node(k, p, f"nccl_protocols.{name}."),
                                             at_most=1.0 if k == "bandwidth_fraction" else None)
                                     for k in ("base_s", "intra_hop_s", "inter_hop_s", "bandwidth_fraction")))))
    return tuple(out)


def _host(r: _Reader) -> HostCosts | None:
    """The optional `host` block: seconds per call of every host primitive (common/ops/host.py), plain and,
    optionally, under torch.profiler, on the CPU and torch it names; its launch latency."""
    if "host" not in r.data:
        return None
    block = r.sourced("host")
    tables = {}
    for key in ("seconds", "profiled_seconds"):
        table = block.get(key)
        if table is None and key == "profiled_seconds":
            continue
        if not isinstance(table, dict):
            raise r.fail(f"host.{key}", "must map each host primitive to its seconds per call")
        absent = [op for op in HOST_PRIMITIVES if op not in table]
        if absent:
            raise r.fail(f"host.{key}", f"has no {', '.join(absent)}")
        found = (*HOST_PRIMITIVES, *(op for op in GRAPH_PRIMITIVES if op in table))  # graph prices are optional
        tables[key] = {op: r.check(f"host.{key}.{op}", table[op], zero=True) for op in found}
    for field in ("cpu", "torch"):
        if not isinstance(block.get(field), str) or not block[field].strip():
            raise r.fail(f"host.{field}", "must name the host's " + ("CPU model" if field == "cpu" else "torch"))
    return HostCosts(seconds=tables["seconds"], profiled=tables.get("profiled_seconds", {}),
                     source=f"hardware file {r.path.name}: {block['source']} ({block['cpu']}; torch {block['torch']})",
                     launch_latency=r.inner("host", "launch_latency_s"), engine_contexts=_engine_contexts(r, block),
                     megatron_context=_megatron_context(r, block))


def _engine_contexts(r: _Reader, block: dict) -> tuple[float, float] | None:
    """The optional `host.engine_contexts`: this engine's recipes' forward and backward contexts calibrated on runs
    of this host (runs/bench/host_contexts.py), with their source."""
    found = block.get("engine_contexts")
    if found is None:
        return None
    if not isinstance(found, dict) or not isinstance(found.get("source"), str) or not found["source"].strip():
        raise r.fail("host.engine_contexts", "must hold forward, backward and their source")
    return tuple(r.check(f"host.engine_contexts.{k}", found.get(k)) for k in ("forward", "backward"))


def _megatron_context(r: _Reader, block: dict) -> float | None:
    """The optional `host.megatron_context`: Megatron-LM's recipes' context calibrated on a Megatron-LM run of this
    host (runs/bench/host_model.py --write), with its source."""
    return r.number("host.megatron_context") if "megatron_context" in block else None


def _hardware(r: _Reader) -> Hardware:
    version = r.node("schema_version")
    if version != SCHEMA_VERSION:
        raise r.fail("schema_version", f"is {version!r}; this version reads {SCHEMA_VERSION}")
    for field in ("name", "description", "version"):
        if not isinstance(r.node(field), str) or not r.node(field).strip():
            raise r.fail(field, "must be a non-empty string")
    peaks = r.node("peak_flops")
    if not isinstance(peaks, dict) or "bf16" not in peaks:
        raise r.fail("peak_flops", "must hold at least bf16")
    return Hardware(
        name=r.node("name"), description=r.node("description"), version=r.node("version"),
        peak_flops=tuple((dtype, r.number(f"peak_flops.{dtype}")) for dtype in sorted(peaks)),
        hbm_bytes=int(r.number("hbm_bytes", integer=True)), hbm_bandwidth=r.number("hbm_bandwidth"),
        gpus_per_node=int(r.number("gpus_per_node", integer=True)),
        gemm=GemmCost(fixed_s=r.inner("gemm", "fixed_s", zero=True),
                      compute_efficiency=r.inner("gemm", "compute_efficiency", at_most=1.0),
                      epilogue_efficiency=r.inner("gemm", "epilogue_efficiency"),
                      grouped_slowdown=r.inner("grouped_gemm", "slowdown") if "grouped_gemm" in r.data else 1.0),
        attention=AttentionCost(fwd=_attention(r, "fwd"), bwd=_attention(r, "bwd")),
        memory=_memory(r),
        sustained=Sustained(threshold_efficiency=r.inner("sustained", "threshold_efficiency"),
                            slope=r.inner("sustained", "slope"),
                            threshold_share=r.inner("power_limit", "threshold_share", at_most=1.0)
                            if "power_limit" in r.data else None),
        nvlink_bus_bandwidth=r.number("intra_node.bus_bandwidth"),
        nvlink_p2p_bandwidth=r.number("intra_node.p2p_bandwidth"),
        nic_bandwidth=r.number("inter_node.nic_bandwidth"),
        nic_efficiency=r.number("inter_node.efficiency", at_most=1.0),
        protocols=_protocols(r),
        overheads=DeviceOverheads(device=r.node("name"), provenance=r.sourced("outside_pytorch")["source"],
                                  **{k: int(r.inner("outside_pytorch", k, integer=True)) for k in OVERHEAD_TERMS},
                                  allocator_workspaces=int(r.number(WORKSPACES, integer=True))
                                  if WORKSPACES in r.data else 0),
        path=str(r.path), host=_host(r))


def load_hardware(spec: str) -> Hardware:
    """The hardware of a known kind (case-insensitive) or of a JSON file; ConfigError (one line) when it cannot."""
    path = _path_of(spec)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"hardware file {path}: cannot be read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"hardware file {path}: not valid JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"hardware file {path}: must hold a JSON object")
    return _hardware(_Reader(path, data))


def run_device(ranks: Iterable[RankInfo]) -> str | None:
    """The GPU a run ran on, as its manifest's rank entries name it ("NVIDIA H200"); None when they do not say."""
    names = {r.device.name for r in ranks} - {None}
    return ", ".join(sorted(names)) or None


def kind_of(hardware_name: str) -> str:
    """The part of a hardware kind a device name contains: "a100" of "A100-80GB" (in "NVIDIA A100-SXM4-80GB")."""
    return hardware_name.split("-")[0].lower()


def hardware_for(device: str | None, spec: str | None) -> Hardware:
    """--hardware when given; else the known kind the device name contains (the H200 file for "NVIDIA H200")."""
    if spec is not None:
        return load_hardware(spec)
    for name in sorted(known_names(), key=len, reverse=True):
        if device and kind_of(name) in device.lower():
            return load_hardware(name)
    raise ConfigError(f"the run's device ({device or 'not recorded'}) is no known hardware kind "
                      f"({', '.join(known_names())}): pass --hardware")
