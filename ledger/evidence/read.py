"""Which reader a run directory needs: ours (ledger.evidence.run) or Megatron-LM's (ledger.evidence.megatron)."""
from __future__ import annotations

from pathlib import Path

from ledger.evidence.megatron import ingest
from ledger.evidence.run import RunEvidence, collect_run


def read_run(run_dir: str | Path) -> RunEvidence:
    """A run directory's evidence, read once: every consumer takes this object, never the path."""
    run_dir = Path(run_dir)
    if ingest.is_megatron_run(run_dir):
        return ingest.collect(run_dir)
    return collect_run(run_dir)
