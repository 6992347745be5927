"""One rank's HTA cross-check in a process of its own, under a memory cap and a time budget, so that HTA (which
loads a whole trace into pandas: about 650 MB and 10-25 s for a 270k-event trace on a 2-core machine) can never
exhaust the machine or hold a reconciliation up for long.

Parent: `run_capped` starts `python -m ledger.reconcile.hta_job MEMORY_MIB RANK PATH`, kills it when the budget is
spent and says why no figure came back. Child: caps its data segment (RLIMIT_DATA, which counts the heap and every
private writable mapping: close to what the process really uses, where RLIMIT_AS also counts shared libraries),
runs HTA and prints {"overlap": fraction or null} as its last stdout line; HTA's own chatter goes to stderr. Arrow's
default allocator reserves 1 GiB of address space up front, which the cap would count, so the child uses the system
allocator (ARROW_DEFAULT_MEMORY_POOL=system).
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MODULE = "ledger.reconcile.hta_job"
OUT_OF_MEMORY = 3  # the child's exit status when HTA raised MemoryError under the cap
ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the ledger package


@dataclass(frozen=True)
class Outcome:
    """HTA's overlap for one rank (None when HTA found no communication), or why none came back."""
    overlap: float | None = None
    problem: str | None = None


def run_capped(rank: int, path: Path, memory_mib: int, seconds: float) -> Outcome:
    env = dict(os.environ, ARROW_DEFAULT_MEMORY_POOL="system",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run([sys.executable, "-m", MODULE, str(memory_mib), str(rank), str(path)], env=env,
                              capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return Outcome(problem=f"over its time budget of {seconds:g} s")
    if done.returncode == OUT_OF_MEMORY:
        return Outcome(problem=f"over its memory cap of {memory_mib:,} MiB")
    if done.returncode != 0:  # a library that fails to allocate may abort or exit rather than raise MemoryError
        how = (f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0 else
               f"exit status {done.returncode}")
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return Outcome(problem=f"HTA failed under its memory cap of {memory_mib:,} MiB ({how}: {last[:200]})")
    return Outcome(overlap=json.loads(done.stdout.strip().splitlines()[-1])["overlap"])


def hta_overlap(files: dict[int, Path]) -> dict[int, float]:
    """HTA's comp_comm_overlap per rank, as a fraction.

    Built from HTA's Trace with use_multiprocessing=False rather than TraceAnalysis: HTA's parallel parser forks a
    process pool, and a fork from a threaded host (the Streamlit dashboard computes reconciliations live) can
    deadlock. The traces are parsed one after the other instead; the figures are the same."""
    from hta.analyzers.communication_analysis import CommunicationAnalysis
    from hta.common.trace import Trace
    from hta.configs.parser_config import ParserConfig

    previous = ParserConfig.get_default_cfg()
    cfg = previous.clone()
    cfg.set_args(ParserConfig.get_minimum_args() + ParserConfig.ARGS_COMMUNICATION)
    ParserConfig.set_default_cfg(cfg)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the result
            # HTA reads a relative path under its default trace_dir, not the working directory
            trace = Trace(trace_files={r: str(Path(p).resolve()) for r, p in files.items()})
            trace.load_traces(include_last_profiler_step=False, use_multiprocessing=False)
            df = CommunicationAnalysis.get_comm_comp_overlap(trace, visualize=False)
    finally:
        ParserConfig.set_default_cfg(previous)
    # HTA divides by the communication time it found: NaN when it kept no communication kernel
    return {int(r): float(p) / 100.0 for r, p in zip(df["rank"], df["comp_comm_overlap_pctg"]) if p == p}


def main(argv: list[str]) -> int:
    memory_mib, rank, path = int(argv[0]), int(argv[1]), Path(argv[2])
    cap = memory_mib << 20
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    try:
        overlap = hta_overlap({rank: path}).get(rank)
    except MemoryError:
        return OUT_OF_MEMORY
    print(json.dumps({"overlap": overlap}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
