"""What is live at a run's allocator peak, by the code that allocated it: the memory snapshot that
--record-memory-history writes (RUN/memory/rank<r>.snapshot.pickle, or Megatron-LM's), its allocation trace replayed
to the largest moment, each live block put under its innermost frame in the project (engine/, megatron/) and the
frames above that.

It is how the peak's phases (ledger/models/formulas/peak_phases.py) are checked against a run: which backward the
peak falls in, and which tensors beside the saved activations set it.

    python3 runs/bench/peak_moment.py RUN_OR_SNAPSHOT [--top 25]
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.errors import InputError  # noqa: E402
from ledger.evidence.memory_snapshot import read_snapshot, replay_to_peak  # noqa: E402

PROJECT = ("/engine/", "/megatron/", "/probes/")
MIB = 2 ** 20


def site(frames: list[dict[str, Any]], depth: int = 2) -> str:
    """The innermost `depth` project frames as file:function:line, innermost first; the innermost frame where none is
    the project's (a backward the autograd engine runs in C++ has none)."""
    ours = [f for f in frames if any(p in str(f.get("filename", "")) for p in PROJECT)][:depth]
    shown = ours or frames[:1]
    if not shown:
        return "no Python frame (autograd's C++ engine)"
    return " < ".join(f"{Path(str(f.get('filename'))).name}:{f.get('name')}:{f.get('line')}" for f in shown)


def snapshot_path(arg: Path) -> Path:
    if arg.is_dir():
        found = sorted((arg / "memory").glob("rank*.snapshot.pickle")) or sorted(arg.glob("*.pickle"))
        if not found:
            raise InputError(arg, "no memory snapshot here (--record-memory-history writes "
                                  "RUN/memory/rank<r>.snapshot.pickle)")
        return found[-1]
    return arg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run directory or a snapshot pickle")
    ap.add_argument("--top", type=int, default=25, help="sites listed (default 25)")
    a = ap.parse_args(argv)
    if a.top < 1:
        print(f"peak_moment.py: --top {a.top}: must be at least 1", file=sys.stderr)
        return 2
    try:
        path = snapshot_path(a.run)
        trace = next((t for t in read_snapshot(path)["device_traces"] if t), None)
        if trace is None:
            raise InputError(path, "the allocation trace is empty (--record-memory-history off?)")
        moment = replay_to_peak(trace, path)
    except InputError as exc:
        print(f"peak_moment.py: {exc}", file=sys.stderr)
        return 2
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for block in moment.live:
        entry = by_site[site(block.get("frames") or [])]
        entry[0] += block["size"]
        entry[1] += 1
    print(f"{path}: {len(trace):,} trace events; the peak {moment.peak:,} B ({moment.peak / MIB:,.1f} MiB) at event "
          f"{moment.index:,}, {len(moment.live):,} blocks live")
    setter = moment.setter
    print(f"set by an alloc of {setter['size'] / MIB:,.1f} MiB at {site(setter.get('frames') or [], depth=6)}")
    for name, (size, count) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"  {size / MIB:11,.1f} MiB  {count:6,} block(s)  {name}")
    print("command: python3 " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
