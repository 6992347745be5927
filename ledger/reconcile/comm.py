"""Communication volume per step per rank, by (group, collective): the formulas (ledger.models.formulas.comm) against
the engine's counters (the `bytes` the probes' comm ranges carry) and the trace's collective arguments.

All three use nccl-tests' "size" convention: the all-reduce buffer, the all-gather output, the reduce-scatter input,
and for point-to-point the bytes sent plus received (the engine's P2P range counts both directions of one batched
exchange; the formula lists sends and receives separately and they are summed here).
Point-to-point volume in a trace is counted from the dispatcher's `c10d::send` / `c10d::recv_` ops (NCCL's SendRecv
kernels carry no sizes; ledger.evidence.traces), whose TensorList inputs record element counts but no element type: the
elements are multiplied by the size of the run's params dtype (the activations' dtype the pipeline sends), and the
row says so.
CPU (gloo) traces carry no process-group ranks: ledger.evidence.trace_groups names them from the evidence, and an op
with a collective that nothing names ("unknown" group) is reported as totals per op over all groups, its other ops
per group. gloo's own annotation is no measurement of three collectives (GLOO_UNTRACEABLE); ledger.evidence.traces reads
each through the c10d op that issued it, and only an op with an annotation that no c10d op matched keeps the formula and
the engine's counters and says why the measured column is empty. The backend is the manifest's (else
distributedInfo's).
"""
from __future__ import annotations

from collections import defaultdict
from statistics import mean

from common.config import RunConfig
from common.events import COMM_CATEGORY_GROUP
from ledger.evidence.layout import group_kind
from ledger.evidence.run import RankEvidence, after_first_step
from ledger.evidence.traces import TraceSummary, normalize_op
from ledger.models.formulas.bytes_per_param import DTYPE_BYTES
from ledger.models.formulas.comm import grad_group, step_collectives
from ledger.reconcile.rows import Row, row

VOLUME_TOL = 0.02
Key = tuple[str, str]  # (group kind, op)
# What gloo's own annotation cannot measure, and why (torch's ProcessGroupGloo record_function annotations): it
# matters only for an annotation that no c10d op matched (ledger.evidence.traces), which hides the ops listed in
# UNMATCHED_HIDES.
GLOO_UNTRACEABLE = {
    "reduce_scatter": "gloo runs a reduce-scatter as an all-reduce and its trace records it as gloo:all_reduce",
    "all_reduce": "gloo's trace records its reduce-scatters as gloo:all_reduce too, so the traced total mixes both",
    "all_gather": "gloo's trace records an all-gather's input only, not the gathered size",
}
UNMATCHED_HIDES = {"all_reduce": ("all_reduce", "reduce_scatter"), "all_gather": ("all_gather",)}


def untraceable_ops(backend: str | None, summary: TraceSummary) -> dict[str, str]:
    """Ops whose trace figure is not a measurement, with the reason: on gloo, the ops that an annotation matched to no
    issuing c10d op may hide; none on NCCL."""
    if backend != "gloo":
        return {}
    hidden = {op for c in summary.collectives if c.issued_in is None for op in UNMATCHED_HIDES.get(c.op, ())}
    return {op: f"{GLOO_UNTRACEABLE[op]}, and some gloo annotations matched no c10d op that issued them"
            for op in sorted(hidden)}


def volume_op(op: str) -> str:
    """Sends and receives count as one point-to-point figure, as nccl-tests and the formulas do."""
    return "send_recv" if op in ("send", "recv", "send_recv") else op


def predicted_volume(cfg: RunConfig, pp_rank: int) -> dict[Key, int]:
    out: dict[Key, int] = defaultdict(int)
    for c in step_collectives(cfg, pp_rank).values():
        out[(c.group, volume_op(c.kind))] += c.size_bytes
    return dict(out)


def counter_volume(r: RankEvidence) -> dict[Key, float]:
    """Mean bytes per step from the engine's comm ranges (only those that carry `bytes`), over every step but the
    run's first when there are others: under --overlap-param-gather a step's param all-gather runs at the start of
    the next step's forward, so the first step has none (no earlier update) while the formula's steady step has one."""
    per_step: dict[int, dict[Key, int]] = defaultdict(lambda: defaultdict(int))
    counted = [t for t in r.timing if COMM_CATEGORY_GROUP.get(t.category) and t.bytes is not None]
    for t in after_first_step(counted, lambda t: t.step):
        group = COMM_CATEGORY_GROUP[t.category]
        op = "send_recv" if group == "pp" else normalize_op(t.name) or "unknown"
        per_step[t.step][(group, op)] += int(t.bytes)
    return _mean_over_steps(per_step)


def trace_volume(summary: TraceSummary, groups: dict[str, tuple[int, ...]],
                 p2p_element_bytes: int | None) -> dict[Key, float]:
    """Mean bytes per traced step by (group, op); P2P from the dispatcher's send/recv ops (CPU clock, CPU step
    windows) at `p2p_element_bytes` per element (None: P2P not counted)."""
    per_step: dict[int, dict[Key, int]] = defaultdict(lambda: defaultdict(int))
    windows = summary.windows()
    for c in summary.collectives:
        step = step_of(windows, c.start)
        if step is None or c.bytes is None:
            continue
        op = volume_op(c.op)
        per_step[step][(group_kind(groups, c.group, op, c.issued_as), op)] += c.bytes
    if p2p_element_bytes is not None:
        for p2p in summary.p2p:
            step = step_of(summary.steps, p2p.start)
            if step is not None:
                per_step[step][("pp", "send_recv")] += p2p.elements * p2p_element_bytes
    return _mean_over_steps(per_step)


def step_of(windows: dict[int, tuple[float, float]], t: float) -> int | None:
    """The step whose window holds time `t`, None outside every window."""
    return next((step for step, (lo, hi) in windows.items() if lo <= t <= hi), None)


def p2p_element_bytes(cfg: RunConfig | None) -> int | None:
    return DTYPE_BYTES[cfg.train.params_dtype] if cfg is not None else None


def _mean_over_steps(per_step: dict[int, dict[Key, int]]) -> dict[Key, float]:
    keys = {k for step in per_step.values() for k in step}
    return {k: mean(step.get(k, 0) for step in per_step.values()) for k in keys}


def volume_rows(cfg: RunConfig | None, r: RankEvidence, measured: dict[Key, float] | None,
                untraceable: dict[str, str] | None = None) -> list[Row]:
    """One row per (group, op); `untraceable` ops (untraceable_ops) get no measured figure from the trace."""
    untraceable = untraceable or {}
    predicted = predicted_volume(cfg, r.stage) if cfg is not None else {}
    counters = _in_grad_group(counter_volume(r), cfg)
    if measured is not None:
        measured = _p2p_in_group(measured, cfg)
    unnamed = {op for group, op in measured or {} if group == "unknown"}
    if unnamed:
        predicted, counters, measured = (_by_op(v, unnamed) for v in (predicted, counters, measured or {}))
    traced = measured is not None
    measured = measured or {}
    rows = []
    for group, op in sorted(set(predicted) | set(counters) | set(measured)):
        key = (group, op)
        measures = traced and op not in untraceable
        # a traced step without the collective moved 0 bytes of it: absence in a trace is a measurement
        rows.append(row(f"comm.{group}.{op}.bytes_per_step", "rank", predicted=predicted.get(key),
                        inventory=counters.get(key), measured=measured.get(key, 0.0) if measures else None,
                        unit="bytes",
                        tolerance=VOLUME_TOL,
                        explanation=_explain(group, op, key in counters, traced, untraceable.get(op), cfg),
                        rank=r.rank, stage=r.stage, source="trace" if measures else "events"))
    return rows


def p2p_group(cfg: RunConfig | None) -> str:
    """The group a trace's point-to-point ops (which record no ranks) belong to: the pipeline's, or, under context
    parallelism without pipelining, ring attention's. With both, they are counted as the pipeline's (a trace cannot
    tell them apart: a limitation the cp row then shows as unmeasured traffic)."""
    if cfg is not None and cfg.parallel.context_parallel_size > 1 and cfg.parallel.pipeline_model_parallel_size == 1:
        return "cp"
    return "pp"


def _p2p_in_group(volume: dict[Key, float], cfg: RunConfig | None) -> dict[Key, float]:
    """trace_volume counts every traced point-to-point op as the pipeline's: under p2p_group's rule, the ring's."""
    group = p2p_group(cfg)
    return {(group if key == ("pp", "send_recv") else key[0], key[1]): v for key, v in volume.items()}


def _in_grad_group(volume: dict[Key, float], cfg: RunConfig | None) -> dict[Key, float]:
    """The engine's "dp-comm" ranges run over the gradient-reduction group, which under context parallelism is
    Megatron's dp_cp (ledger.models.formulas.comm.grad_group): counted under the formula's name for it."""
    group = grad_group(cfg) if cfg is not None else "dp"
    return {(group if g == "dp" else g, op): v for (g, op), v in volume.items()}


def _by_op(volume: dict[Key, float], ops: set[str]) -> dict[Key, float]:
    """`ops`' figures summed over all groups under the "unknown" group; other ops' kept per group."""
    out: dict[Key, float] = defaultdict(float)
    for (group, op), value in volume.items():
        out[("unknown", op) if op in ops else (group, op)] += value
    return dict(out)


def _explain(group: str, op: str, counted: bool, traced: bool, untraceable: str | None,
             cfg: RunConfig | None) -> str:
    parts = [f"nccl-tests size of every {op} on the {group} group in one step"]
    if traced and op == "send_recv" and cfg is not None:
        parts.append(f"measured: c10d::send / c10d::recv_ element counts x {p2p_element_bytes(cfg)} B, the run's "
                     f"params dtype {cfg.train.params_dtype} (a TensorList input records no element type)")
    if not counted:
        parts.append("the engine counts no bytes for it (timers off, or a range without bytes)")
    if not traced:
        parts.append("no trace for this rank")
    elif untraceable:
        parts.append(f"not measured: the trace is no measurement of it on the gloo backend ({untraceable})")
    if traced and group == "unknown":
        parts.append("gloo trace: no group recorded, and for some of these collectives neither the engine range "
                     "that issued them nor their worker thread names one (ledger/evidence/trace_groups.py): "
                     "totals per op over all groups")
    return "; ".join(parts)
