"""Throughput rows: tokens per step and per second, model TFLOP/s per GPU and MFU under both FLOPs conventions
(Megatron's num_floating_point_operations and PaLM's 6N + 12 L q s), and the spread of step time across ranks.

Step time is the median over steps after the first (the first carries one-time work). A straggler shows as a rank
whose median step time sits above the run's median; the run row gives the worst per-step spread (max - min) / median.
MFU is only computed for GPUs whose dense peak is known; on CPU the row says so rather than inventing a peak.
"""
from __future__ import annotations

from statistics import median
from typing import Any

from ledger.formulas.flops import H200_BF16_DENSE_PEAK, megatron_flops_per_step, palm_flops_per_token, tokens_per_step
from ledger.reconcile.evidence import RunEvidence, after_first_step
from ledger.reconcile.rows import Row, row, threshold_row

# Dense 16-bit peaks (FLOP/s) by device name fragment; MFU needs the device's own peak, never a guess.
PEAKS = {"H200": H200_BF16_DENSE_PEAK, "H100": 989e12, "A100": 312e12}
STRAGGLER_TOL = 0.05


def steady_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return after_first_step([r for r in records if r.get("step_time_s")], lambda r: r.get("step") or 0)


def device_peak(manifest: dict[str, Any]) -> tuple[float | None, str]:
    ranks = manifest.get("ranks") or []
    device = (ranks[0].get("device") or {}) if ranks and isinstance(ranks[0], dict) else {}
    name = str(device.get("name", ""))
    if device.get("type") != "cuda":
        return None, f"no MFU on {device.get('type') or 'an unknown device'}: no GPU peak to divide by"
    for fragment, peak in PEAKS.items():
        if fragment in name:
            return peak, f"{name}: dense 16-bit peak {peak / 1e12:.0f} TFLOP/s"
    return None, f"no known dense peak for {name!r}: MFU not computed"


def throughput_rows(ev: RunEvidence) -> list[Row]:
    per_rank = {rank: steady_steps(r.steps) for rank, r in ev.ranks.items()}
    per_rank = {rank: s for rank, s in per_rank.items() if s}
    if not per_rank:
        return []
    cfg = ev.config
    all_steps = [s for steps in per_rank.values() for s in steps]
    step_time = median(s["step_time_s"] for s in all_steps)
    tokens = [s["tokens"] for s in all_steps if s.get("tokens") is not None]
    rows = [row("throughput.tokens_per_step", "run", predicted=tokens_per_step(cfg) if cfg else None,
                measured=median(tokens) if tokens else None, unit="tokens", tolerance=0.0,
                explanation="global batch x sequence length", source="events"),
            row("throughput.tokens_per_s", "run", measured=median(tokens) / step_time if tokens else None,
                unit="tokens/s", tolerance=0.0, explanation=f"median step time {step_time * 1e3:.1f} ms over "
                                                             f"{len(all_steps)} rank-steps after the first",
                source="events")]
    if cfg is not None:
        rows += flops_rows(ev, step_time)
    rows += straggler_rows(per_rank, step_time)
    return rows


def flops_rows(ev: RunEvidence, step_time: float) -> list[Row]:
    cfg = ev.config
    peak, peak_note = device_peak(ev.manifest)
    conventions = {"megatron": megatron_flops_per_step(cfg),
                   "palm_6n": palm_flops_per_token(cfg) * tokens_per_step(cfg)}
    rows = []
    for name, flops in conventions.items():
        per_gpu = flops / step_time / ev.world_size
        rows.append(row(f"throughput.tflops_per_gpu.{name}", "run", measured=per_gpu / 1e12, unit="TFLOP/s",
                        tolerance=0.0, explanation=f"{flops:.3e} FLOPs per step ({name} convention) / step time / "
                                                   f"{ev.world_size} GPUs", source="events"))
        rows.append(row(f"throughput.mfu.{name}", "run", measured=per_gpu / peak if peak else None,
                        unit="fraction", tolerance=0.0, explanation=peak_note, source="events"))
    return rows


def straggler_rows(per_rank: dict[int, list[dict[str, Any]]], run_median: float) -> list[Row]:
    rows = []
    for rank, steps in sorted(per_rank.items()):
        rows.append(row("throughput.step_time", "rank", predicted=run_median,
                        measured=median(s["step_time_s"] for s in steps), unit="s", tolerance=STRAGGLER_TOL,
                        explanation="this rank's median step time against the run's median (a straggler is above "
                                    "it)", rank=rank, source="events"))
    by_step: dict[int, list[float]] = {}
    for steps in per_rank.values():
        for s in steps:
            by_step.setdefault(s.get("step"), []).append(s["step_time_s"])
    spreads = {step: (max(t) - min(t)) / median(t) for step, t in by_step.items() if len(t) > 1}
    if spreads:
        worst = max(spreads, key=spreads.get)
        rows.append(threshold_row("throughput.step_time_spread", "run", measured=spreads[worst],
                                  warn_at=STRAGGLER_TOL, off_at=4 * STRAGGLER_TOL, unit="fraction",
                                  explanation=f"(max - min) / median step time across ranks, worst step {worst}",
                                  step=worst, source="events"))
    return rows
