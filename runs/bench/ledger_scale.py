"""Time and peak memory of `train-ledger reconcile`, `report` and `export-trace` on an N-rank run directory built
from one real recorded run, each command a subprocess of its own.

    python runs/bench/ledger_scale.py --ranks 8 64 [--source RUN] [--inflate-to EVENTS] [--keep DIR]
                                      [--commands reconcile report export-trace] [--env NAME=VALUE ...]

The N-rank run: rank r is a rank-shifted copy of the source run's rank r % W (W its world size; the source must
have no pipeline parallelism, so that the copies are more data-parallel replicas): its events.jsonl as recorded,
its trace with distributedInfo rank / world size rewritten, and every process group's ranks (the trace's "Process
Group Ranks", "Group size" and distributedInfo.pg_config) mapped to the new run: a group equal to a DP group of the
source becomes the new DP group (all copies of its members), every other group is shifted to the copy's ranks. (In
a one-rank source every group is {0}, its DP group, so every group becomes all N ranks; its traced collectives
record no ranks at all.) The manifest gets the new world size, the copies' rank entries and a global batch scaled
with the data-parallel size, so every rank keeps its micro-batches.

--inflate-to: a source trace smaller than a real one is grown to about that many events by replicating its
ProfilerStep windows (copy j shifted by j x the trace's span, its steps renumbered after the last, flow and
correlation ids shifted so they stay unique): more steps of the same work, as a longer profiler window would record.

Peak memory is the process tree's (the command and every worker or HTA subprocess it starts), summed over the tree
and sampled every 50 ms; the largest single process's peak (ru_maxrss of the waited child tree) is printed beside it.
The run is built in a process of its own so that no measured command inherits the builder's memory.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "gpu_h200_llama1b_l2"
STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
ID_SHIFT = 10_000_000  # larger than any flow / correlation id one trace holds


# ---- building the run ----------------------------------------------------------------------------------------------

def source_trace(source: Path) -> Path:
    traces = sorted((source / "traces").glob("rank*.json*"))
    if not traces:
        raise SystemExit(f"{source}: no traces")
    return traces[0]


def inflate(doc: dict[str, Any], target: int) -> dict[str, Any]:
    """The trace with its ProfilerStep windows replicated until it holds about `target` events."""
    events = doc["traceEvents"]
    copies = max(1, round(target / len(events)))
    timed = [e for e in events if e.get("ph") not in ("M", "i") and "ts" in e]
    lo = min(float(e["ts"]) for e in timed)
    span = max(float(e["ts"]) + float(e.get("dur", 0)) for e in timed) - lo + 1000.0
    steps = sorted(int(m.group(1)) for e in timed if (m := STEP_RE.match(str(e.get("name", "")))))
    first, count = steps[0], steps[-1] - steps[0] + 1
    out = list(events)
    for j in range(1, copies):
        for e in timed:
            c = dict(e, ts=e["ts"] + j * round(span))
            m = STEP_RE.match(str(c.get("name", "")))
            if m:
                c["name"] = f"ProfilerStep#{int(m.group(1)) + j * count}"
            if c.get("ph") in ("s", "t", "f") and isinstance(c.get("id"), int):
                c["id"] += j * ID_SHIFT
            args = c.get("args")
            if isinstance(args, dict):
                c["args"] = args = dict(args)
                for key in ("External id", "correlation"):
                    if isinstance(args.get(key), int):
                        args[key] += j * ID_SHIFT
            out.append(c)
    block = doc.get("trainLedger")
    if isinstance(block, dict) and "steps_recorded" in block:
        block["steps_recorded"] = [first, first + copies * count - 1]
    return dict(doc, traceEvents=out)


class GroupMap:
    """A source group's ranks as seen by copy `c` of the source run in the N-rank run."""

    def __init__(self, source_manifest: dict[str, Any], world: int):
        sys.path.insert(0, str(REPO))
        from ledger.reconcile.topology import rank_groups

        self.source_world = int(source_manifest["world_size"])
        self.copies = world // self.source_world
        self.dp = {tuple(rank_groups(source_manifest, r).get("dp", (r,))) for r in range(self.source_world)}

    def __call__(self, ranks: list[int], copy: int) -> list[int]:
        if tuple(sorted(ranks)) in self.dp:
            return sorted(r + c * self.source_world for c in range(self.copies) for r in ranks)
        return [r + copy * self.source_world for r in ranks]


def template(doc: dict[str, Any]) -> tuple[str, list[list[int]]]:
    """The trace as JSON text with a placeholder where each copy differs: every process group's rank list (its
    "Process Group Ranks" and "Group size"), and distributedInfo's rank, world size and pg_config."""
    groups: list[list[int]] = []
    events = []
    for e in doc["traceEvents"]:
        args = e.get("args")
        if isinstance(args, dict) and "Process Group Ranks" in args:
            ranks = args["Process Group Ranks"]
            ranks = json.loads(ranks) if isinstance(ranks, str) else ranks
            args = dict(args, **{"Process Group Ranks": f"@@PGR{len(groups)}@@", "Group size": f"@@PGS{len(groups)}@@"})
            groups.append(list(ranks))
            e = dict(e, args=args)
        events.append(e)
    info = doc.get("distributedInfo") or {}
    for pg in info.get("pg_config") or []:
        groups.append(list(pg.get("ranks", [])))
        pg["ranks"], pg["pg_size"] = f"@@PGL{len(groups) - 1}@@", f"@@PGS{len(groups) - 1}@@"
    return json.dumps(dict(doc, traceEvents=events, distributedInfo=dict(info, rank="@@RANK@@",
                                                                       world_size="@@WORLD@@"))), groups


def rank_text(text: str, groups: list[list[int]], rank: int, world: int, copy: int, mapping: GroupMap) -> str:
    mapped = [mapping(g, copy) for g in groups]

    def sub(m: re.Match) -> str:
        kind, i = m.group(1), m.group(2)
        if kind == "RANK":
            return str(rank)
        if kind == "WORLD":
            return str(world)
        g = mapped[int(i)]
        return {"PGR": json.dumps(json.dumps(g)), "PGL": json.dumps(g), "PGS": str(len(g))}[kind]

    return re.sub(r'"@@(RANK|WORLD|PGR|PGL|PGS)(\d*)@@"', sub, text)


def build(source: Path, out: Path, world: int, inflate_to: int) -> None:
    manifest = json.loads((source / "manifest.json").read_text())
    w0 = int(manifest["world_size"])
    parallel = manifest["config"]["parallel"]
    if parallel.get("pipeline_model_parallel_size", 1) != 1 or world % w0:
        raise SystemExit(f"{source}: needs a source without pipeline parallelism and a world size dividing {world}")
    mapping = GroupMap(manifest, world)
    trace = source_trace(source)
    doc = json.load(gzip.open(trace, "rt") if trace.name.endswith(".gz") else open(trace))
    if inflate_to:
        doc = inflate(doc, inflate_to)
    text, groups = template(doc)
    (out / "ranks").mkdir(parents=True)
    (out / "traces").mkdir()
    steps = re.match(r"rank\d+\.(step\d+-\d+)\.json", trace.name).group(1)
    for r in range(world):
        copy, r0 = divmod(r, w0)
        shutil.copytree(source / "ranks" / f"rank{r0}", out / "ranks" / f"rank{r}")
        body = rank_text(text, groups, r, world, copy, mapping)
        with gzip.open(out / "traces" / f"rank{r}.{steps}.json.gz", "wt", encoding="utf-8", compresslevel=6) as f:
            f.write(body)
    entries = manifest["ranks"]
    manifest["ranks"] = [dict(entries[r % w0], rank=r,
                              coords=dict(entries[r % w0]["coords"], dp=entries[r % w0]["coords"]["dp"] + (r // w0) *
                                          (w0 // max(1, parallel.get("tensor_model_parallel_size", 1) *
                                                     parallel.get("context_parallel_size", 1)))))
                         for r in range(world)]
    manifest["world_size"] = parallel["world_size"] = world
    manifest["config"]["train"]["global_batch_size"] *= world // w0
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    what = (f"{world} ranks from {source}" + (f" inflated to {inflate_to:,} events" if inflate_to else "") +
            f" ({len(doc['traceEvents']):,} events a trace, {len(text) / 2**20:.1f} MiB of JSON)")
    (out.parent / f"{out.name}.source.txt").write_text(what + "\n")
    print(f"built {out}: {what}", flush=True)


# ---- measuring -----------------------------------------------------------------------------------------------------

def tree_usage(root: int) -> dict[int, tuple[int, float]]:
    """pid -> (VmRSS KiB, CPU seconds so far) for `root` and its descendants (the forkserver's workers included)."""
    children: dict[int, list[int]] = {}
    usage: dict[int, tuple[int, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read().rsplit(")", 1)[1].split()  # fields after the command name
            with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as f:
                rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            continue
        children.setdefault(int(stat[1]), []).append(int(entry))
        usage[int(entry)] = (rss, (int(stat[11]) + int(stat[12])) / tick)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in usage:
            out[pid] = usage[pid]
        todo += children.get(pid, [])
    return out


def measure(argv: list[str], env: dict[str, str], log: Path) -> tuple[float, float, float, float, int]:
    """(wall s, CPU s of the process tree, peak tree RSS MiB, largest single process's peak MiB, exit status) of
    one command; its stderr (the progress lines, with their times) goes to `log`. CPU seconds (user + system, summed
    over every process of the tree as last sampled, so up to 50 ms short per process) tell what the command costs on a
    machine other work shares."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "cli", *argv], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    peak = 0
    cpu: dict[int, float] = {}
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.05):
            tree = tree_usage(proc.pid)
            peak = max(peak, sum(rss for rss, _ in tree.values()))
            for pid, (_, seconds) in tree.items():
                cpu[pid] = max(cpu.get(pid, 0.0), seconds)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    err = proc.stderr.read()
    log.write_text(err)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        print(err[-3000:], file=sys.stderr)
    return wall, sum(cpu.values()), peak / 1024, usage.ru_maxrss / 1024, proc.returncode


def command(name: str, run: Path, root: Path) -> list[str]:
    return {"reconcile": ["reconcile", str(run), "--out", str(root / "ledger")],
            "report": ["report", str(run), "--out", str(root / "ledger")],
            "export-trace": ["export-trace", str(run), "--out", str(root / "merged.json.gz")]}[name]


def versions() -> str:
    found = []
    for name in ("msgspec", "orjson", "hta"):
        try:
            module = __import__(name)
            found.append(f"{name} {getattr(module, '__version__', '?')}")
        except ImportError:
            found.append(f"{name} absent")
    return f"Python {platform.python_version()}, " + ", ".join(found)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8])
    p.add_argument("--source", type=Path, default=FIXTURE, help="a recorded run (default: the committed fixture "
                                                                    "gpu_h200_llama1b_l2, inflated)")
    p.add_argument("--inflate-to", type=int, help="grow the source trace to about this many events "
                                                  "(default 270000 for the fixture, none for a full run)")
    p.add_argument("--keep", type=Path, help="build the runs under this folder and keep them (reused when there)")
    p.add_argument("--commands", nargs="+", default=["reconcile", "report", "export-trace"],
                   choices=["reconcile", "report", "export-trace"])
    p.add_argument("--env", nargs="*", default=[], help="NAME=VALUE for the measured commands")
    p.add_argument("--build", nargs=4, metavar=("SOURCE", "OUT", "WORLD", "INFLATE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.build:
        build(Path(a.build[0]), Path(a.build[1]), int(a.build[2]), int(a.build[3]))
        return
    source = a.source
    inflate_to = a.inflate_to if a.inflate_to is not None else (270_000 if source == FIXTURE else 0)
    root = a.keep or Path(tempfile.mkdtemp(prefix="ledger-scale-"))
    env = dict(os.environ, PYTHONPATH=str(REPO), TRAIN_LEDGER_PROGRESS="1",
               **dict(item.split("=", 1) for item in a.env))
    print(f"command: python runs/bench/ledger_scale.py {shlex.join(sys.argv[1:])}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {versions()}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for world in a.ranks:
        run = root / f"run{world}"
        if not (run / "manifest.json").is_file():
            t0 = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--build", str(source), str(run), str(world), str(inflate_to)],
                           check=True)
            print(f"  (built in {time.perf_counter() - t0:.0f} s)")
        size = sum(f.stat().st_size for f in (run / "traces").iterdir()) / 2**20
        print(f"run: {(root / f'run{world}.source.txt').read_text().strip()}; {size:.0f} MiB of gzip traces")
        (root / f"out{world}").mkdir(exist_ok=True)
        for name in a.commands:
            argv = command(name, run, root / f"out{world}")
            wall, cpu, tree, single, rc = measure(argv, env, root / f"out{world}" / f"{name}.stderr")
            print(f"  {name:<13}{wall:7.1f} s wall, {cpu:6.1f} s CPU, peak RSS {tree:6.0f} MiB (process tree), "
                  f"largest process {single:5.0f} MiB, exit {rc}, load {os.getloadavg()[0]:.1f}   "
                  f"train-ledger {shlex.join(argv)}", flush=True)


if __name__ == "__main__":
    main()
