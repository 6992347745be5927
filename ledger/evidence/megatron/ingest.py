"""A Megatron-LM run directory, read into the same evidence the engine's runs give, so it reconciles through the
same rows. Two layouts:

1. What Megatron-LM itself writes (no wrapper; ledger.evidence.megatron.tensorboard has the details):

    RUN/
      <tensorboard dir>/   --tensorboard-dir (any name, directly under RUN): the last rank's event files, with every
                           argument as a text summary (the configuration) and the per-iteration scalars
      torch_profile/rank-<R>.json.gz   --profile --use-pytorch-profiler (Megatron writes them to
                           --tensorboard-dir/../torch_profile)

   RUN is the folder that holds the TensorBoard directory (Megatron's torch_profile/ lands there too); the
   TensorBoard directory itself is refused with a line saying so. With several launches in one TensorBoard directory
   (a resumed run), the configuration is the last launch's and the scalars are merged, a later launch's value
   winning at an iteration both logged.

2. What runs/megatron/run.sh writes:

    RUN/
      megatron_run.json    {"framework": "megatron-lm", "argv": [pretrain_gpt.py flags...], "world_size": N,
                            "run_id", "started", "ended", "exit_code", "megatron_path", "megatron_git_sha"}
                           (ended / exit_code are null while the run is going, or if the script was killed)
      tb/                  --tensorboard-dir: the TensorBoard event files, as above, and the traces of the Megatron-LM
                           versions that wrote them there: <host>_<pid>.<time>.pt.trace.json[.gz]
                           (tensorboard_trace_handler), each with distributedInfo naming its rank; newer versions
                           write RUN/torch_profile/ as in layout 1
      logs/                torchrun's output

What maps where: the configuration (argv, or the argument summaries through megatron_arguments) is parsed with our
Megatron flag parser (what the formulas do not model is listed in `missing`, not guessed); TensorBoard mem-* scalars
become the last rank's per-step memory_stats (reserved_bytes.all.current, allocated_bytes.all.current,
allocated_bytes.all.peak; Megatron never resets the peak, so every step's peak is the running maximum; TensorBoard
keeps scalars as float32, so byte counts carry about 7 significant digits); iteration-time becomes the step time,
each step flagged as the probes flag theirs (profiled / after the trace export) from Megatron's profiler schedule.
Megatron's own timers (--log-timers-to-tensorboard with --timing-log-level 1 or 2: "<timer>-time" scalars, seconds
per iteration, the max over ranks) and its throughput scalar (TFLOP/s per GPU by its FLOP count) are kept in the
manifest under TIMERS and THROUGHPUT for ledger/reconcile/megatron_timers.py. Megatron writes no inventory, NVML or
bandwidth sweep: those rows say so.
"""
from __future__ import annotations

import json
import re
import zlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common.arguments import build_parser
from common.config import RunConfig
from common.errors import ConfigError, InputError
from common.events import MemoryRecord, StepRecord
from common.megatron.flag_effects import classify
from common.megatron.options import parse_command_line
from common.rank_info import DeviceInfo, RankInfo
from common.run_dir import TraceFile
from ledger.evidence.megatron.arguments import flags_from_arguments, run_config_of
from ledger.evidence.megatron.tensorboard import (
    PROFILE_DIR,
    EventFile,
    has_event_files,
    merged_scalars,
    profile_traces,
    read_event_files,
    tensorboard_dirs,
)
from ledger.evidence.memory_snapshot import peak_split
from ledger.evidence.run import RankEvidence, RunEvidence, missing_items
from ledger.evidence.trace_stream import open_trace_text

META = "megatron_run.json"
MANIFEST = "manifest.json"
TB_DIR = "tb"
TRACE_RE = re.compile(r".*\.pt\.trace\.json(\.gz)?$")
RANK_RE = re.compile(r'"distributedInfo"\s*:\s*\{[^}]*?"rank"\s*:\s*(\d+)')
DEVICE_RE = re.compile(r'"deviceProperties"\s*:\s*\[\s*\{[^}]*?"name"\s*:\s*"([^"]+)"')
HEAD_BYTES = 1 << 20
MEMORY_TAGS = {"mem-reserved-bytes": "reserved_bytes.all.current",
               "mem-allocated-bytes": "allocated_bytes.all.current",
               "mem-max-allocated-bytes": "allocated_bytes.all.peak"}
BY_SAMPLES = " vs samples"
TIMER_SUFFIX = "-time"  # Megatron's timers.write: "<timer>-time", the max over ranks, seconds per iteration
TIMERS = "megatron_timers"  # manifest keys of the timers' and the throughput scalar's {step: value}
THROUGHPUT = "megatron_throughput"
SCALARS_ONLY = ("Megatron-LM run: memory, step time and Megatron's timers come from the last rank's TensorBoard "
                "scalars only; no inventory, per-range timers, NVML or bandwidth sweep")


def is_megatron_run(run_dir: Path) -> bool:
    """Megatron-LM's layout, not ours (no manifest.json): run.sh's megatron_run.json, or TensorBoard event files in
    run_dir or in a folder directly under it (collect says which of those is a Megatron-LM run and which is not)."""
    if not run_dir.is_dir() or (run_dir / MANIFEST).is_file():
        return False
    return (run_dir / META).is_file() or has_event_files(run_dir) or bool(tensorboard_dirs(run_dir))


def collect(run_dir: Path) -> RunEvidence:
    return collect_run_sh(run_dir) if (run_dir / META).is_file() else collect_own_layout(run_dir)


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


def status_of(meta: dict[str, Any]) -> tuple[str, str | None]:
    code = meta.get("exit_code")
    if code is None:
        return "running", None
    return ("complete", None) if code == 0 else ("failed", f"exit code {code}")


def trace_head(path: Path) -> str:
    """The first MiB of a trace: Kineto writes deviceProperties and distributedInfo before the events."""
    try:
        with open_trace_text(path) as f:
            return f.read(HEAD_BYTES)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise InputError(path, f"corrupt or truncated gzip ({exc.__class__.__name__})") from None


def trace_device(path: Path) -> str | None:
    """The GPU a trace was recorded on, as its deviceProperties name it ("NVIDIA H200"); None for a CPU trace."""
    m = DEVICE_RE.search(trace_head(path))
    return m.group(1) if m else None


def trace_rank(path: Path) -> int:
    """The rank in a trace's distributedInfo."""
    m = RANK_RE.search(trace_head(path))
    if m is None:
        raise InputError(path, "no distributedInfo rank in the trace's head: cannot tell whose trace it is")
    return int(m.group(1))


def profiled_window(cfg: RunConfig) -> tuple[int, int]:
    """The iterations Megatron-LM's torch profiler records: torch.profiler.schedule(wait=start-1, warmup=1,
    active=end-start), stepped at the top of every iteration, records ProfilerStep#start..#end-1, and step N is
    iteration N (the one TensorBoard logs at step N)."""
    return cfg.probes.profile_step_start, cfg.probes.profile_step_end - 1


def megatron_traces(run_dir: Path, tb_dir: Path, cfg: RunConfig) -> list[TraceFile]:
    """(rank, first, last profiled iteration, path) of every trace: RUN/torch_profile/rank-<R>.json.gz and the older
    *.pt.trace.json in the TensorBoard directory, each rank read from the trace's distributedInfo (a file named for
    another rank is refused). One trace per rank: what export-trace merges, no manifest needed."""
    first, last = profiled_window(cfg)
    found = []
    for named, path in profile_traces(run_dir):
        rank = trace_rank(path)
        if rank != named:
            raise InputError(path, f"named for rank {named}, but its distributedInfo says rank {rank}")
        found.append((rank, path))
    if tb_dir.is_dir():
        found += [(trace_rank(p), p) for p in sorted(tb_dir.rglob("*")) if TRACE_RE.match(p.name)]
    seen: dict[int, Path] = {}
    for rank, path in found:
        if rank in seen:
            raise InputError(path, f"second trace for rank {rank} (also {seen[rank].name}): one profiled window "
                                   "per run directory")
        seen[rank] = path
    return sorted(TraceFile(rank, first, last, path) for rank, path in seen.items())


def disturbed_steps(cfg: RunConfig, profile: bool) -> tuple[set[int], set[int]]:
    """(profiled, after trace export) iterations under Megatron-LM's --profile, as ledger.evidence.steps reads the
    probes' flags. torch profiler: its warm-up iteration start-1 traces too (the events are discarded, the cost is
    not) and start..end-1 are recorded; the trace is exported inside iteration `end` (at the profiler step at its
    top), so that iteration's time holds the export even with one rank. nsys (--profile alone): cudaProfilerStart
    before iteration start+1, stop after iteration end."""
    if not profile:
        return set(), set()
    start, end = cfg.probes.profile_step_start, cfg.probes.profile_step_end
    if not cfg.probes.use_pytorch_profiler:
        return set(range(start + 1, end + 1)), set()
    return set(range(max(start - 1, 1), end)), {end}


def last_rank_evidence(rank: int, coords: dict[str, int], scalars: dict[str, dict[int, float]], tokens: int,
                       disturbed: tuple[set[int], set[int]]) -> RankEvidence:
    ev = RankEvidence(rank=rank, coords=coords)
    steps = sorted({s for tag in MEMORY_TAGS if tag in scalars for s in scalars[tag]})
    for step in steps:
        stats = {key: int(scalars[tag][step]) for tag, key in MEMORY_TAGS.items() if step in scalars.get(tag, {})}
        ev.memory_steps.append(MemoryRecord(step=step, point="step", device="cuda", stats=stats))
    profiled, after_export = disturbed
    for step, seconds in sorted(scalars.get("iteration-time", {}).items()):
        ev.steps.append(StepRecord(step=step, step_time_s=seconds, tokens=tokens,
                                   loss=scalars.get("lm loss", {}).get(step), profiled=step in profiled,
                                   after_trace_export=step in after_export))
    return ev


def snapshot_path(run_dir: Path, arguments: dict[str, str]) -> Path | None:
    """Where the run's memory snapshot lies, by --memory-snapshot-path's file name in the run directory (Megatron-LM
    writes it relative to its working directory); None without --record-memory-history."""
    if arguments.get("record_memory_history") != "True":
        return None
    return run_dir / Path(arguments.get("memory_snapshot_path") or "snapshot.pickle").name


def add_snapshot(ev: RunEvidence, path: Path | None) -> None:
    """The last rank's memory snapshot split at its peak, or a line of `missing` saying it is not there."""
    if path is None:
        return
    rank = ev.world_size - 1
    if not path.is_file():
        ev.missing.append(f"--record-memory-history was on but {path.name} is not in the run directory: no memory "
                          "snapshot to split the peak by term")
    elif rank in ev.ranks:
        ev.ranks[rank].memory_snapshot = peak_split(path)


def evidence(run_dir: Path, manifest: dict[str, Any], cfg: RunConfig, scalars: dict[str, dict[int, float]],
             traces: list[TraceFile], profile: bool) -> RunEvidence:
    """Both layouts' evidence from their configuration, scalars and traces, with what Megatron does not write."""
    device = trace_device(traces[0].path) if traces else None
    # one kind of GPU per run: the traced ranks' name stands for every rank's
    infos = {r: RankInfo(rank=r, device=DeviceInfo(type="cuda", name=device))
             for r in range(cfg.parallel.world_size)} if device is not None else {}
    if infos:
        manifest["ranks"] = [info.to_json() for info in infos.values()]
    manifest[TIMERS] = {tag.removesuffix(TIMER_SUFFIX): values for tag, values in scalars.items()
                        if tag.endswith(TIMER_SUFFIX) and tag != "iteration-time"}
    manifest[THROUGHPUT] = scalars.get("throughput", {})
    ev = RunEvidence(run_dir=run_dir, manifest=manifest, config=cfg, ranks={}, traces=traces,
                     framework="megatron-lm", rank_infos=infos)
    if scalars:
        rank = ev.world_size - 1
        ev.ranks[rank] = last_rank_evidence(rank, ev.coords(rank), scalars,
                                            cfg.train.global_batch_size * cfg.model.seq_length,
                                            disturbed_steps(cfg, profile))
    ev.missing = [SCALARS_ONLY] + [m for m in missing_items(ev, our_probes=False)
                                   if not m.startswith("no events for rank")]
    if "mem-allocated-bytes" not in scalars:
        ev.missing.append("no mem-* TensorBoard scalars (--log-memory-to-tensorboard)")
    if "iteration-time" not in scalars:
        ev.missing.append("no iteration-time TensorBoard scalars (--log-timers-to-tensorboard)")
    return ev


def torn_tails(files: list[EventFile], run_dir: Path) -> list[str]:
    return [f"{f.path.relative_to(run_dir)} ends in a torn record (killed mid-write): last record skipped"
            for f in files if f.torn_tail]


def collect_run_sh(run_dir: Path) -> RunEvidence:
    meta = read_meta(run_dir)
    try:
        line = parse_command_line([str(a) for a in meta["argv"]], strict=False)
    except ConfigError as exc:
        raise InputError(run_dir / META, f"argv: {exc}") from None
    cfg, unmodelled, assumed = run_config_of(line.arguments, meta["world_size"], run_dir / META, source="argv")
    status, error = status_of(meta)
    manifest = {"schema_version": 1, "run_id": meta.get("run_id") or run_dir.name, "framework": "megatron-lm",
                "argv": meta["argv"], "config": cfg.to_dict(), "world_size": meta["world_size"], "status": status,
                "error": error, "started": meta.get("started"), "ended": meta.get("ended")}
    tb_dir = run_dir / TB_DIR
    files = read_event_files(tb_dir) if tb_dir.is_dir() else []
    scalars = merged_scalars(files)
    traces = megatron_traces(run_dir, tb_dir, cfg)
    if not scalars and not traces:
        raise InputError(run_dir, f"empty Megatron run: no TensorBoard scalars or traces under {TB_DIR}/")
    ev = evidence(run_dir, manifest, cfg, scalars, traces, profile="--profile" in meta["argv"])
    add_snapshot(ev, snapshot_path(run_dir, line.arguments))
    ev.missing += torn_tails(files, run_dir)
    if line.unknown:
        ev.missing.append(f"flags Megatron-LM {line.megatron_sha[:10]} does not know (skipped): "
                          + " ".join(line.unknown))
    if not_modelled := classify(line).not_modelled:
        ev.missing.append("Megatron flags the formulas do not model (their defaults assumed): "
                          + " ".join(not_modelled))
    if unmodelled:
        ev.missing.append("Megatron arguments not modelled by the formulas (predictions assume otherwise): "
                          + ", ".join(unmodelled))
    ev.missing += [f"assumed: {note}" for note in assumed]
    return ev


def collect_own_layout(run_dir: Path) -> RunEvidence:
    """Megatron-LM's own run directory: the configuration from the last launch's argument summaries."""
    tb_dir = own_tensorboard_dir(run_dir)
    files = read_event_files(tb_dir)
    launches = [f for f in files if f.arguments]
    if not launches:
        raise InputError(tb_dir, "no argument text summaries (Megatron-LM writes every argument at start-up): not "
                                 "a Megatron-LM TensorBoard directory")
    last = launches[-1]
    world = world_size_of(last)
    argv, _ = flags_from_arguments(last.arguments, build_parser("megatron-lm", megatron_model=True))
    cfg, unmodelled, assumed = run_config_of(last.arguments, world, last.path)
    scalars = merged_scalars(files)
    status, error = own_status(scalars, cfg.train.train_iters)
    manifest = {"schema_version": 1, "run_id": run_dir.name, "framework": "megatron-lm", "argv": argv,
                "config": cfg.to_dict(), "world_size": world, "status": status, "error": error,
                "started": _iso(files[0].start), "ended": _iso(files[-1].end),
                "arguments_from": str(last.path.relative_to(run_dir))}
    traces = megatron_traces(run_dir, tb_dir, cfg)
    ev = evidence(run_dir, manifest, cfg, scalars, traces, profile=last.arguments.get("profile") == "True")
    add_snapshot(ev, snapshot_path(run_dir, last.arguments))
    ev.missing += torn_tails(files, run_dir)
    if len(launches) > 1:
        ev.missing.append(f"{len(launches)} launches wrote to {tb_dir.name}/ (a resumed run): the configuration is the "
                          f"last one's, from iteration {last.arguments_step}" + changed_flags(launches))
    if unmodelled:
        ev.missing.append("Megatron arguments not modelled by the formulas (predictions assume otherwise): "
                          + ", ".join(unmodelled))
    ev.missing += [f"assumed: {note}" for note in assumed]
    return ev


def own_tensorboard_dir(run_dir: Path) -> Path:
    if has_event_files(run_dir):
        raise InputError(run_dir, "a TensorBoard directory, not a run directory: pass the folder that holds it, where "
                                  f"Megatron-LM also writes {PROFILE_DIR}/ (--tensorboard-dir/../{PROFILE_DIR})")
    dirs = tensorboard_dirs(run_dir)
    if len(dirs) != 1:
        names = ", ".join(d.name for d in dirs)
        raise InputError(run_dir, f"{len(dirs)} TensorBoard directories ({names}): one Megatron-LM run per run "
                                  "directory")
    return dirs[0]


def world_size_of(launch: EventFile) -> int:
    value = launch.arguments.get("world_size")
    if value is None or not value.isdigit() or int(value) < 1:
        raise InputError(launch.path, f"argument world_size {value!r} is not a positive integer")
    return int(value)


def own_status(scalars: dict[str, dict[int, float]], train_iters: int | None) -> tuple[str, str | None]:
    """complete when the scalars reach --train-iters; Megatron-LM records no exit status, so otherwise the run
    stopped early or is still going, and the status says "running" as a run.sh run's does without an exit code.
    Tags "<name> vs samples" are keyed by consumed samples, not iterations, and are left out."""
    last = max((s for tag, values in scalars.items() if not tag.endswith(BY_SAMPLES) for s in values), default=None)
    if train_iters is not None and last is not None and last >= train_iters:
        return "complete", None
    return "running", f"TensorBoard scalars end at iteration {last} of {train_iters}: stopped or still running"


def changed_flags(launches: list[EventFile]) -> str:
    """'; flags that changed between launches: ...' (empty when the launches agree on every flag we read)."""
    parser = build_parser("megatron-lm", megatron_model=True)
    flags = [set(_pairs(flags_from_arguments(f.arguments, parser)[0])) for f in launches]
    changed = sorted({flag for pairs in flags for flag, _ in pairs ^ flags[-1]})
    return f"; flags that changed between launches: {' '.join(changed)}" if changed else ""


def _pairs(argv: list[str]) -> list[tuple[str, str]]:
    """(flag, its values joined) of an argv of flags, switches with an empty value."""
    out: list[tuple[str, str]] = []
    for item in argv:
        if item.startswith("--"):
            out.append((item, ""))
        else:
            flag, value = out[-1]
            out[-1] = (flag, f"{value} {item}".strip())
    return out


def _iso(wall_time: float | None) -> str | None:
    return None if wall_time is None else datetime.fromtimestamp(wall_time, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
