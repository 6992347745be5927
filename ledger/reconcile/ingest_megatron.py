"""A Megatron-LM run directory, read into the same evidence the engine's runs give, so it reconciles through the
same rows. runs/megatron/run.sh writes this layout:

    RUN/
      megatron_run.json    {"framework": "megatron-lm", "argv": [pretrain_gpt.py flags...], "world_size": N,
                            "run_id", "started", "ended", "exit_code", "megatron_path", "megatron_git_sha"}
                           (ended / exit_code are null while the run is going, or if the script was killed)
      tb/                  --tensorboard-dir: Megatron's TensorBoard event files, written by the last rank:
                           mem-reserved-bytes / mem-allocated-bytes / mem-max-allocated-bytes
                           (--log-memory-to-tensorboard), iteration-time (--log-timers-to-tensorboard), ...
                           and the profiler's traces, one per profiled rank:
                           <host>_<pid>.<time>.pt.trace.json[.gz] (--profile --use-pytorch-profiler; Megatron's
                           tensorboard_trace_handler), each with distributedInfo naming its rank
      logs/                torchrun's output

What maps where: the argv is parsed with our Megatron flag parser (flags this project does not model are listed
in `missing`, not guessed); TensorBoard mem-* scalars become the last rank's per-step memory_stats
(reserved_bytes.all.current, allocated_bytes.all.current, allocated_bytes.all.peak; Megatron never resets the peak,
so every step's peak is the running maximum; TensorBoard keeps scalars as float32, so byte counts carry about 7
significant digits); iteration-time becomes the step time. Megatron writes no inventory,
timers, NVML or bandwidth sweep: those rows say so.
"""
from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Any

from common.arguments import build_parser, resolve
from common.config import RunConfig, validate
from common.errors import ConfigError, InputError
from ledger.reconcile.evidence import RankEvidence, RunEvidence, derived_coords, missing_items
from ledger.traces import open_trace_text

META = "megatron_run.json"
TB_DIR = "tb"
TRACE_RE = re.compile(r".*\.pt\.trace\.json(\.gz)?$")
RANK_RE = re.compile(r'"distributedInfo"\s*:\s*\{[^}]*?"rank"\s*:\s*(\d+)')
HEAD_BYTES = 1 << 20
MEMORY_TAGS = {"mem-reserved-bytes": "reserved_bytes.all.current",
               "mem-allocated-bytes": "allocated_bytes.all.current",
               "mem-max-allocated-bytes": "allocated_bytes.all.peak"}


def is_megatron_run(run_dir: Path) -> bool:
    return (run_dir / META).is_file() and not (run_dir / "manifest.json").is_file()


def read_meta(run_dir: Path) -> dict[str, Any]:
    path = run_dir / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(path, f"corrupt JSON ({exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("argv"), list):
        raise InputError(path, "expected an object with an 'argv' list")
    world = meta.get("world_size")
    if not isinstance(world, int) or world < 1:
        raise InputError(path, f"world_size {world!r} is not a positive integer")
    return meta


def parse_megatron_argv(argv: list[str], world_size: int, path: Path) -> tuple[RunConfig, list[str]]:
    """Our RunConfig from Megatron's flags, and the flags we do not model (reported, never silently used)."""
    ns, unknown = build_parser("megatron-lm").parse_known_args([str(a) for a in argv])
    ns.run_dir = None
    try:
        cfg = resolve(ns, world_size=world_size)
        validate(cfg)
    except ConfigError as exc:
        raise InputError(path, f"argv: {exc}") from None
    return cfg, [a for a in unknown if a.startswith("--")]


def status_of(meta: dict[str, Any]) -> tuple[str, str | None]:
    code = meta.get("exit_code")
    if code is None:
        return "running", None
    return ("complete", None) if code == 0 else ("failed", f"exit code {code}")


def tb_scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from every event file under tb_dir (the last value of a step wins)."""
    # the legacy loader yields the records as written (simple_value); the other one rewrites them as tensors
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    out: dict[str, dict[int, float]] = {}
    for path in sorted(tb_dir.rglob("events.out.tfevents.*")):
        try:
            for event in LegacyEventFileLoader(str(path)).Load():
                for value in event.summary.value:
                    if value.HasField("simple_value"):
                        out.setdefault(value.tag, {})[event.step] = value.simple_value
        except Exception as exc:  # noqa: BLE001 - tensorboard raises its own DataLossError tree for corrupt records
            raise InputError(path, f"corrupt TensorBoard event file ({exc.__class__.__name__})") from None
    return out


def trace_rank(path: Path) -> int:
    """The rank in a trace's distributedInfo, read from the file's head (Kineto writes it before the events)."""
    try:
        with open_trace_text(path) as f:
            head = f.read(HEAD_BYTES)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise InputError(path, f"corrupt or truncated gzip ({exc.__class__.__name__})") from None
    m = RANK_RE.search(head)
    if m is None:
        raise InputError(path, "no distributedInfo rank in the trace's head: cannot tell whose trace it is")
    return int(m.group(1))


def megatron_traces(tb_dir: Path, cfg: RunConfig) -> list[tuple[int, int, int, Path]]:
    found = []
    seen: dict[int, Path] = {}
    for path in sorted(p for p in tb_dir.rglob("*") if TRACE_RE.match(p.name)):
        rank = trace_rank(path)
        if rank in seen:
            raise InputError(path, f"second trace for rank {rank} (also {seen[rank].name}): one profiled window "
                                   "per run directory")
        seen[rank] = path
        found.append((rank, cfg.probes.profile_step_start, cfg.probes.profile_step_end, path))
    return sorted(found)


def last_rank_evidence(manifest: dict[str, Any], scalars: dict[str, dict[int, float]], tokens: int) -> RankEvidence:
    rank = manifest["world_size"] - 1
    ev = RankEvidence(rank=rank, coords=derived_coords(manifest, rank))
    steps = sorted({s for tag in MEMORY_TAGS if tag in scalars for s in scalars[tag]})
    for step in steps:
        record = {"kind": "memory", "point": "step", "step": step, "device": "cuda"}
        for tag, key in MEMORY_TAGS.items():
            if step in scalars.get(tag, {}):
                record[key] = int(scalars[tag][step])
        ev.memory_steps.append(record)
    for step, seconds in sorted(scalars.get("iteration-time", {}).items()):
        ev.steps.append({"kind": "step", "step": step, "step_time_s": seconds, "tokens": tokens,
                         "loss": scalars.get("lm loss", {}).get(step)})
    return ev


def collect(run_dir: Path) -> RunEvidence:
    meta = read_meta(run_dir)
    cfg, unmodelled = parse_megatron_argv(meta["argv"], meta["world_size"], run_dir / META)
    status, error = status_of(meta)
    manifest = {"schema_version": 1, "run_id": meta.get("run_id") or run_dir.name, "framework": "megatron-lm",
                "argv": meta["argv"], "config": cfg.to_dict(), "world_size": meta["world_size"], "status": status,
                "error": error, "started": meta.get("started"), "ended": meta.get("ended")}
    tb_dir = run_dir / TB_DIR
    scalars = tb_scalars(tb_dir) if tb_dir.is_dir() else {}
    traces = megatron_traces(tb_dir, cfg) if tb_dir.is_dir() else []
    ranks = {}
    if scalars:
        last = last_rank_evidence(manifest, scalars, cfg.train.global_batch_size * cfg.model.seq_length)
        ranks[last.rank] = last
    if not ranks and not traces:
        raise InputError(run_dir, f"empty Megatron run: no TensorBoard scalars or traces under {TB_DIR}/")
    ev = RunEvidence(run_dir=run_dir, manifest=manifest, config=cfg, ranks=ranks, traces=traces,
                     framework="megatron-lm")
    ev.missing = [m for m in missing_items(ev) if not m.startswith("no events for rank")]
    ev.missing.insert(0, "Megatron-LM run: memory and step time come from the last rank's TensorBoard scalars only; "
                         "no inventory, timers, NVML or bandwidth sweep")
    if unmodelled:
        ev.missing.append("Megatron flags not modelled by the formulas: " + " ".join(unmodelled))
    if "mem-allocated-bytes" not in scalars:
        ev.missing.append("no mem-* TensorBoard scalars (--log-memory-to-tensorboard)")
    return ev
