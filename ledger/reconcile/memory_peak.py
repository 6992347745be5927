"""The peak allocated, judged in two parts so that a gap names its side, and the peak's terms:

  memory.allocated_after_step  what the allocator holds between steps (the step records' allocated, steps after
                               the first): static + the device's cuBLAS / cuBLASLt workspaces + Megatron-LM's
                               global memory buffer                                            1% or 8 MiB
  memory.peak_above_allocated  the step's peak above that (the largest peak minus it): the peak phase's saved
                               activations and transients (ledger/models/formulas/peak_phases.py)          5%
  memory.peak_allocated        their sum against the largest peak the allocator recorded                   5%
  memory.peak_term.<term>      each term of the prediction alone, largest first in the peak row's explanation:
                               formula only (one allocator figure cannot be split), unless a memory snapshot
                               splits the peak by allocation site (ledger/evidence/memory_snapshot.py)        5%
The split and the terms are emitted for both engines' layers, whose phases and transients peak_phases.py models
(this engine's last stage peaks in its loss's or its output layer's backward). The workspaces come from the
device's calibration (ledger/models/calibration/<device>.json); a device without one
gets none, and the explanation says so. 8 MiB: the small tensors a run keeps between steps (RoPE tables, loss
accumulators, RNG state), 1.4 to 4.9 MiB on our H200 runs.
"""
from __future__ import annotations

import re
from statistics import median

from common.config import RunConfig
from ledger.evidence.memory_snapshot import REST, PeakSplit
from ledger.evidence.run import RankEvidence
from ledger.models.formulas.activations import chunk_layers_text, layer_saved_tensors, recompute_label
from ledger.models.formulas.device_memory import DeviceOverheads
from ledger.models.formulas.peak_memory import persistent_bytes
from ledger.models.formulas.peak_phases import Phase, peak_phase
from ledger.models.formulas.static_memory import static_bytes
from ledger.reconcile.rows import Row, row

PEAK_TOL = 0.05
BETWEEN_TOL, BETWEEN_ABS = 0.01, 8 * 2 ** 20
MIB = 2 ** 20


def workspaces_of(device_name: str | None) -> tuple[int, str]:
    """(the device's allocator workspaces, where that figure comes from)."""
    device = DeviceOverheads.known(device_name) if device_name else None
    if device is None or not device.allocator_workspaces:
        return 0, f"no allocator workspaces known for {device_name or 'this device'} (ledger/models/calibration/)"
    return device.allocator_workspaces, f"workspaces: {device.device} calibration"


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f} MiB"


def _slug(name: str) -> str:
    """A term's row name: its name before any parenthesis, as an identifier ("output_layer_logits")."""
    return re.sub(r"[^a-z0-9]+", "_", name.split(" (")[0].lower().replace("'", "")).strip("_")


def layer_terms(cfg: RunConfig, count: int = 3) -> str:
    """A layer's largest saved tensors, the ones an activation gap most likely sits in."""
    saved = sorted(layer_saved_tensors(cfg).items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{name} {_mib(n)}" for name, n in saved)


def terms_of(static: int, persistent: dict[str, int], phase: Phase) -> dict[str, int]:
    return {"static (params, grads, optimizer state)": static, **persistent,
            f"saved activations ({phase.name})": phase.activations, **phase.transients}


def _steady(r: RankEvidence) -> tuple[int | None, int | None]:
    """(median allocated after the steps after the first, the largest peak) of the rank's step records."""
    records = [m for m in r.memory_steps if m.allocated is not None]
    first = min((m.step for m in records if m.step is not None), default=None)
    after = [m.allocated for m in records if m.step != first] or [m.allocated for m in records]
    peaks = [m.peak for m in [*r.memory_steps, *r.memory_points.values()] if m.peak is not None]
    return (int(median(after)) if after else None), (max(peaks) if peaks else None)


def peak_rows(cfg: RunConfig | None, r: RankEvidence, device_name: str | None, note: str = "") -> list[Row]:
    where = dict(rank=r.rank, stage=r.stage, source="events")
    between_measured, peak_measured = _steady(r)
    if cfg is None:
        return [row("memory.peak_allocated", "rank", measured=peak_measured, unit="bytes", tolerance=PEAK_TOL,
                    explanation="no run config: nothing to predict" + note, **where)]
    c = r.coords
    workspaces, provenance = workspaces_of(device_name)
    static = static_bytes(cfg, c["tp"], c["pp"], c["dp"], "after_first_step").total
    persistent = persistent_bytes(cfg, workspaces, c["pp"], c["tp"])
    phase = peak_phase(cfg, c["pp"], c["tp"])
    between = static + sum(persistent.values())
    terms = terms_of(static, persistent, phase)
    listed = "; ".join(f"{name} {_mib(n)}" for name, n in sorted(terms.items(), key=lambda kv: -kv[1]))
    recompute = f"recompute {recompute_label(cfg.recompute)}, {cfg.implementation.transformer_impl} layers"
    rows = [
        row("memory.peak_allocated", "rank", predicted=between + phase.total, measured=peak_measured, unit="bytes",
            tolerance=PEAK_TOL, explanation=f"the peak ({phase.name}; {recompute}): {listed}; {provenance}"
                                            + note, **where),
        row("memory.allocated_after_step", "rank", predicted=between, measured=between_measured, unit="bytes",
            tolerance=BETWEEN_TOL, abs_tolerance=BETWEEN_ABS,
            explanation="allocated between steps (median after the first step): static "
                        f"{_mib(static)}" + "".join(f" + {name} {_mib(n)}" for name, n in persistent.items())
                        + f"; {provenance}; judged to 1% or 8 MiB (the small tensors a run keeps)" + note, **where),
        row("memory.peak_above_allocated", "rank", predicted=phase.total,
            measured=peak_measured - between_measured if None not in (peak_measured, between_measured) else None,
            unit="bytes", tolerance=PEAK_TOL,
            explanation=f"the {phase.name}: saved activations {_mib(phase.activations)} "
                        f"({chunk_layers_text(cfg, c['pp'])} a chunk; a layer's largest: {layer_terms(cfg)})"
                        + "".join(f" + {name} {_mib(n)}" for name, n in phase.transients.items())
                        + "; measured: the largest peak minus the allocated between steps" + note, **where),
    ]
    return rows + term_rows(terms, phase, r.memory_snapshot, where)


def term_rows(terms: dict[str, int], phase: Phase, snapshot: PeakSplit | None, where: dict) -> list[Row]:
    """Each term of the predicted peak; measured where a memory snapshot splits the peak by allocation site (the
    blocks live at its trace's largest moment), with what no site names as a row of its own."""
    if snapshot is None:
        return [row(f"memory.peak_term.{_slug(name)}", "rank", predicted=n, unit="bytes", tolerance=PEAK_TOL,
                    explanation=f"{name}: a term of the predicted peak ({phase.name}); formula only", **where)
                for name, n in terms.items()]
    split = (f"measured: the blocks live at the peak of {snapshot.path.name}'s allocation trace "
             f"({snapshot.peak:,} bytes, reached in {snapshot.set_by}; {snapshot.events:,} events replayed), by "
             f"the frames that allocated them (docs/formulas.md, \"Megatron-LM's memory snapshot\")")
    rows = [row(f"memory.peak_term.{_slug(name)}", "rank", predicted=n, measured=snapshot.terms.get(_slug(name)),
                unit="bytes", tolerance=PEAK_TOL,
                explanation=f"{name}: a term of the predicted peak ({phase.name}); {split}", **where)
            for name, n in terms.items()]
    rest = (f"live at the snapshot's peak, allocated outside a forward and the set-up (a backward's weight "
            f"gradient, scalars): no term predicts it; {split}")
    return rows + [row(f"memory.peak_term.{REST}", "rank", measured=snapshot.terms[REST], unit="bytes",
                       tolerance=PEAK_TOL, explanation=rest, **where)]
