"""What if: a run's own layout changed on paper (GPUs, TP / PP / VPP, sequence parallel, batch, recompute, the
distributed optimizer, the GPU kind) and predicted by the simulator, beside the run as measured and as the simulator
predicts its own layout. The dashboard's "What if" page draws these; everything here is torch-free and Streamlit-free.

    basis = run_basis(run_dir)                  # the run's config, device, hardware kind and measured figures
    cfg = RunConfig.from_dict(basis["config"])
    choice = replace(own_choice(cfg), world_size=2 * cfg.parallel.world_size)
    own, changed = predict(cfg, "H200"), predict_choice(cfg, choice, "H200")   # Outcome: prediction or one line
    rows = comparison(basis, own.prediction, changed.prediction)              # the table, raw values and units
    step_chart(basis, own.prediction, changed.prediction)                     # ledger.present.charts.Chart

Why the run's own prediction sits beside the what-if: the simulator's error on this run (predicted vs measured) is
the error bar a reader should put on the what-if; the what-if against the measurement alone would hide it.
The measured side is the run's reconciliation rows (ledger/reconcile), read as ledger.reconcile.validation reads
them; nothing here estimates anything the simulator or the rows do not already give.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import mean
from typing import Any

from common.config import RecomputeConfig, RunConfig, validate
from common.config.pipeline_layers import SIZED_SPLIT_FIELDS
from common.errors import ConfigError, UserError
from ledger.models.formulas.params import num_chunks
from ledger.models.simulate.hardware import hardware_for, load_hardware, run_device
from ledger.models.simulate.simulation import simulate
from ledger.present import units as fmt
from ledger.present.charts import Bar, Chart, stacked
from ledger.present.loaders import RunView, load_rows
from ledger.reconcile.validation import measured, measured_values

RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
SCENARIOS = ("measured run", "predicted, run's layout", "predicted, what-if")
EXPOSED_KINDS = ("dp", "tp", "pp", "embedding")  # the groups whose exposed communication both sides give
# One colour per step-time term, the simulator's (ledger.models.time_model.step) and the measured split's
# (measured_terms); a term the simulator adds later takes the next colour of OTHER_COLORS.
TERM_COLORS = {"forward/backward compute": "#1e88e5", "pipeline bubble": "#bdbdbd", "optimizer": "#8e24aa",
               "DP grad reduction tail": "#e53935", "exposed DP comm": "#e53935", "P2P transfers": "#fb8c00",
               "param all-gather waits": "#6d4c41", "grad buffer memset": "#00897b",
               "SP norm-grad all-reduce": "#fdd835", "embedding grad all-reduce": "#c0ca33",
               "loss all-reduce": "#5c6bc0", "waiting for the other stages": "#90a4ae",
               "not timed (measured step minus the timed terms)": "#e0e0e0",
               "step (no timers to split it)": "#757575"}
OTHER_COLORS = ("#ad1457", "#4e342e", "#26a69a", "#7e57c2")
MEMORY_COLORS = {"static": "#1e88e5", "workspaces, persistent buffers": "#5e35b1", "activations": "#fb8c00",
                 "outside PyTorch": "#8d6e63", "peak allocated (measured)": "#43a047"}
NOT_TIMED = "not timed (measured step minus the timed terms)"
CLOCK_NOISE_S = 1e-6  # a term below a microsecond is rounding of the replay's clock (as `simulate` prints it)


@dataclass(frozen=True)
class Choice:
    """The knobs the page offers: a layout and scale, as the run set them or as the user changes them."""
    world_size: int
    tp: int
    pp: int
    vpp: int  # model chunks per stage; 1 is the plain 1F1B schedule
    sequence_parallel: bool
    micro_batch_size: int
    global_batch_size: int
    recompute: str  # one of RECOMPUTE
    recompute_method: str  # one of RECOMPUTE_METHODS; read with recompute "full" only
    recompute_num_layers: int  # read with recompute "full" only
    distributed_optimizer: bool
    ends_as_layers: bool = False  # the embedding and the loss each counted as a layer of the pipeline split


@dataclass(frozen=True)
class Outcome:
    """A prediction (Simulation.to_dict()), or the one line saying why there is none."""
    prediction: dict[str, Any] | None = None
    error: str | None = None


def own_choice(cfg: RunConfig) -> Choice:
    """The run's own knobs: applying them changes nothing."""
    p, t, r = cfg.parallel, cfg.train, cfg.recompute
    return Choice(world_size=p.world_size, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                  vpp=p.virtual_pipeline_model_parallel_size or 1, sequence_parallel=p.sequence_parallel,
                  micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
                  recompute=r.recompute_granularity or "none", recompute_method=r.recompute_method or "uniform",
                  recompute_num_layers=r.recompute_num_layers or 1,
                  distributed_optimizer=t.use_distributed_optimizer,
                  ends_as_layers=p.account_for_embedding_in_pipeline_split and p.account_for_loss_in_pipeline_split)


def changed_config(cfg: RunConfig, c: Choice) -> RunConfig:
    """The run's config with the choice applied and validated (common.config.validate, as `train` and `simulate`
    validate); ConfigError with one line when the layout cannot run. Three things follow from a choice rather than
    being chosen: without the distributed optimizer there is no param all-gather to overlap, so
    --overlap-param-gather goes with it; a split written for the run's own pipeline (first / last stage counts, a
    spelled-out layout) goes when the pipeline or virtual size changes, the layers then split evenly, or with the
    embedding and the loss counted as layers where the choice says so (Megatron-LM's
    --account-for-embedding/loss-in-pipeline-split, both or neither; a run that set one alone keeps it until the
    choice changes); and the profiled ranks are those of the new world (a profiled
    rank beyond a smaller world would refuse the layout for nothing), the other probes the run's (timers' event reads
    move the host timeline's prediction)."""
    if c.recompute not in RECOMPUTE:
        raise ConfigError(f"recompute {c.recompute!r}: expected one of {', '.join(RECOMPUTE)}")
    full = c.recompute == "full"
    own = own_choice(cfg)
    resized = (c.pp, c.vpp) != (own.pp, own.vpp)
    ends = {} if c.ends_as_layers == own.ends_as_layers else dict(
        account_for_embedding_in_pipeline_split=c.ends_as_layers, account_for_loss_in_pipeline_split=c.ends_as_layers)
    parallel = replace(cfg.parallel, world_size=c.world_size, tensor_model_parallel_size=c.tp,
                       pipeline_model_parallel_size=c.pp,
                       virtual_pipeline_model_parallel_size=c.vpp if c.vpp > 1 else None,
                       sequence_parallel=c.sequence_parallel,
                       **(dict.fromkeys(SIZED_SPLIT_FIELDS) if resized else {}), **ends)
    train = replace(cfg.train, micro_batch_size=c.micro_batch_size, global_batch_size=c.global_batch_size,
                    use_distributed_optimizer=c.distributed_optimizer,
                    overlap_param_gather=cfg.train.overlap_param_gather and c.distributed_optimizer)
    recompute = RecomputeConfig(recompute_granularity=None if c.recompute == "none" else c.recompute,
                                recompute_method=c.recompute_method if full else None,
                                recompute_num_layers=c.recompute_num_layers if full else None)
    probes = replace(cfg.probes, profile_ranks=[r for r in cfg.probes.profile_ranks if r < c.world_size] or [0])
    out = replace(cfg, parallel=parallel, train=train, recompute=recompute, probes=probes)
    validate(out)
    return out


def predict(cfg: RunConfig, hardware: str) -> Outcome:
    """The simulator's prediction of `cfg` on a known GPU kind; the one-line reason when it cannot (a hardware
    file without a peak for the run's dtype, ...)."""
    try:
        return Outcome(prediction=simulate(cfg, load_hardware(hardware)).to_dict())
    except UserError as exc:
        return Outcome(error=str(exc))


def predict_choice(cfg: RunConfig, c: Choice, hardware: str) -> Outcome:
    """`predict` of the run's config with the choice applied; the validation's one line when it is invalid."""
    try:
        changed = changed_config(cfg, c)
    except ConfigError as exc:
        return Outcome(error=str(exc))
    return predict(changed, hardware)


def run_basis(view: RunView) -> dict[str, Any]:
    """What the page needs of a run, as plain values: `config` (RunConfig.to_dict(), None when it cannot be read,
    e.g. a Megatron-LM run whose arguments are missing), `device` (as the manifest names it), `hardware` (the known
    GPU kind of that device, None when it is none: the user picks) and `measured` (measured_figures)."""
    ev = view.evidence
    device = run_device(ev.rank_infos.values())
    try:
        hardware: str | None = hardware_for(device, None).name
    except ConfigError:
        hardware = None
    return {"config": ev.config.to_dict() if ev.config is not None else None, "framework": ev.framework,
            "device": device, "hardware": hardware,
            "measured": measured_figures(load_rows(view), device, ev.config)}


def _reduce(rows: list[dict[str, Any]], metric: str, how: Any) -> float | None:
    values = measured_values(rows, metric)
    return how(values) if values else None


def exposed_label(kind: str) -> str:
    """"exposed TP comm per step": one row name for the run's measurement and the simulator's prediction."""
    return f"exposed {kind.upper() if kind != 'embedding' else kind} comm per step"


def measured_figures(rows: list[dict[str, Any]], device: str | None, cfg: RunConfig | None) -> dict[str, Any]:
    """The run's measured figures from its reconciliation rows: step time, peak allocated and bubble as
    ledger.reconcile.validation.measured reads them; the slowest stage's forward / backward per micro-batch and
    optimizer, exposed communication per kind (largest rank), throughput (mean over rows); and `terms`, the
    measured step split like the simulator's (measured_terms)."""
    m = measured(rows, device)
    out: dict[str, Any] = {"step_time_s": m.step_time, "peak_bytes": m.peak_bytes, "bubble": m.bubble,
                           "device": device}
    for key, metric in (("forward_s", "time.forward_per_microbatch"), ("backward_s", "time.backward_per_microbatch"),
                        ("optimizer_s", "time.optimizer_step")):
        out[key] = _reduce(rows, metric, max)
    out["exposed_comm_s"] = {kind: _reduce(rows, f"overlap.exposed_{kind}_comm_per_step", max)
                             for kind in EXPOSED_KINDS}
    for key, metric in (("tokens_per_s", "throughput.tokens_per_s"),
                        ("tflops_megatron", "throughput.tflops_per_gpu.megatron"),
                        ("tflops_palm_6n", "throughput.tflops_per_gpu.palm_6n"),
                        ("mfu_megatron", "throughput.mfu.megatron"), ("mfu_palm_6n", "throughput.mfu.palm_6n")):
        out[key] = _reduce(rows, metric, mean)
    out["terms"] = measured_terms(rows, cfg, m.step_time)
    return out


def measured_terms(rows: list[dict[str, Any]], cfg: RunConfig | None, step: float | None) -> dict[str, float]:
    """The measured step time split as far as the timers go, on the stage whose forward + backward took longest
    (the critical one): its compute (median forward + backward range x micro-batches x model chunks, the ranges the
    time rows measure), its idle time (its bubble of wall time b over a span of compute + idle: compute x b / (1 -
    b)), its optimizer and exposed DP communication; what the timers do not cover is NOT_TIMED, negative when the
    timed terms overlap (medians of different steps). Without timers, the step in one piece."""
    if step is None:
        return {}
    stages: dict[int, dict[str, float]] = {}
    for r in rows:
        if r.get("measured") is not None and r.get("stage") is not None:
            stages.setdefault(r["stage"], {})[r["metric"]] = r["measured"]
    timed = {s: f for s, f in stages.items()
             if "time.forward_per_microbatch" in f and "time.backward_per_microbatch" in f}
    if cfg is None or not timed:
        return {"step (no timers to split it)": step}
    stage, figures = max(timed.items(), key=lambda kv: kv[1]["time.forward_per_microbatch"]
                         + kv[1]["time.backward_per_microbatch"])
    compute = (cfg.num_microbatches * num_chunks(cfg)
               * (figures["time.forward_per_microbatch"] + figures["time.backward_per_microbatch"]))
    bubble = figures.get("pipeline.bubble_of_wall_time", 0.0)
    terms = {"forward/backward compute": compute,
             "pipeline bubble": compute * bubble / (1 - bubble) if bubble < 1 else 0.0,
             "optimizer": figures.get("time.optimizer_step", 0.0),
             "exposed DP comm": figures.get("overlap.exposed_dp_comm_per_step", 0.0)}
    terms[NOT_TIMED] = step - sum(terms.values())
    return terms


# --- the comparison table --------------------------------------------------------------------------------------
def _layout_text(layout: dict[str, Any]) -> str:
    vpp = f" (VPP{layout['vpp']})" if layout.get("vpp") else ""
    sp = ", SP" if layout["sequence_parallel"] else ""
    return f"{layout['world_size']} = TP{layout['tp']} x DP{layout['dp']} x PP{layout['pp']}{vpp}{sp}"


def _batch_text(layout: dict[str, Any]) -> str:
    return f"micro {layout['micro_batch_size']}, global {layout['global_batch_size']}, seq {layout['seq_length']}"


def _slowest(prediction: dict[str, Any], key: str) -> float:
    return max(s[key] for s in prediction["step"]["per_stage"])


def _predicted(p: dict[str, Any]) -> dict[str, Any]:
    """The comparison's figures of one prediction (Simulation.to_dict()), by row name."""
    stages, memory, th = p["step"]["per_stage"], p["memory"]["per_stage"], p["throughput"]
    return {"hardware": p["hardware"]["name"], "layout": _layout_text(p["layout"]), "batch": _batch_text(p["layout"]),
            "micro-batches per DP rank": p["layout"]["num_microbatches"], "tokens per step": th["tokens_per_step"],
            "recompute": p["layout"]["recompute"], "optimizer strategy": p["layout"]["strategy"],
            "step time": p["step"]["step_time_s"], "forward per micro-batch (slowest stage)": _slowest(p, "forward_s"),
            "backward per micro-batch (slowest stage)": _slowest(p, "backward_s"),
            "optimizer step (slowest stage)": _slowest(p, "optimizer_s"),
            "pipeline bubble (mean over stages)": mean(s["bubble"] for s in stages),
            **{exposed_label(k): max(s["exposed_comm_s"].get(k, 0.0) for s in stages) for k in EXPOSED_KINDS},
            "peak allocated (largest stage)": max(m["static"] + m["activations"] for m in memory),
            "memory per GPU with outside PyTorch (largest stage)": max(m["total"] for m in memory),
            "HBM per GPU": p["hardware"]["hbm_bytes"],
            "fits in HBM": "yes" if p["memory"]["fits"] else "no",
            "tokens/s": th["tokens_per_s"],
            "FLOP/s per GPU (megatron)": th["tflops_per_gpu"]["megatron"],
            "FLOP/s per GPU (palm_6n)": th["tflops_per_gpu"]["palm_6n"],
            "MFU (megatron)": th["mfu"]["megatron"], "MFU (palm_6n)": th["mfu"]["palm_6n"]}


def _measured(basis: dict[str, Any], own: dict[str, Any] | None) -> dict[str, Any]:
    """The comparison's measured figures; the layout rows are the run's own (what the run ran)."""
    m = basis["measured"]
    facts = {k: v for k, v in (own or {}).items() if k in ("layout", "batch", "micro-batches per DP rank",
                                                            "tokens per step", "recompute", "optimizer strategy")}
    return {**facts, "hardware": m["device"] or "not recorded", "step time": m["step_time_s"],
            "forward per micro-batch (slowest stage)": m["forward_s"],
            "backward per micro-batch (slowest stage)": m["backward_s"],
            "optimizer step (slowest stage)": m["optimizer_s"], "pipeline bubble (mean over stages)": m["bubble"],
            **{exposed_label(kind): m["exposed_comm_s"][kind] for kind in EXPOSED_KINDS},
            "peak allocated (largest stage)": m["peak_bytes"], "tokens/s": m["tokens_per_s"],
            "FLOP/s per GPU (megatron)": m["tflops_megatron"], "FLOP/s per GPU (palm_6n)": m["tflops_palm_6n"],
            "MFU (megatron)": m["mfu_megatron"], "MFU (palm_6n)": m["mfu_palm_6n"]}


ROWS = (("hardware", "text"), ("layout", "text"), ("batch", "text"), ("micro-batches per DP rank", "count"),
        ("tokens per step", "tokens"), ("recompute", "text"), ("optimizer strategy", "text"), ("step time", "s"),
        ("forward per micro-batch (slowest stage)", "s"), ("backward per micro-batch (slowest stage)", "s"),
        ("optimizer step (slowest stage)", "s"), ("pipeline bubble (mean over stages)", "fraction"),
        ("exposed DP comm per step", "s"), ("exposed TP comm per step", "s"), ("exposed PP comm per step", "s"),
        ("exposed embedding comm per step", "s"), ("peak allocated (largest stage)", "bytes"),
        ("memory per GPU with outside PyTorch (largest stage)", "bytes"), ("HBM per GPU", "bytes"),
        ("fits in HBM", "text"), ("tokens/s", "tokens/s"), ("FLOP/s per GPU (megatron)", "TFLOP/s"),
        ("FLOP/s per GPU (palm_6n)", "TFLOP/s"), ("MFU (megatron)", "fraction"), ("MFU (palm_6n)", "fraction"))


def comparison(basis: dict[str, Any], own: dict[str, Any] | None, what_if: dict[str, Any] | None
               ) -> list[dict[str, Any]]:
    """One row per figure: {figure, unit, measured, run, what_if} with raw values (None where a column has no
    figure: nothing measured it, or no prediction); `formatted` writes them for a person."""
    columns = {"measured": _measured(basis, _predicted(own) if own else None),
               "run": _predicted(own) if own else {}, "what_if": _predicted(what_if) if what_if else {}}
    return [{"figure": name, "unit": unit, **{col: values.get(name) for col, values in columns.items()}}
            for name, unit in ROWS]


def formatted(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The comparison as a person reads it (ledger.present.units), with the what-if's change against the run's own
    prediction: the simulator's error cancels in that ratio, not in what-if vs measured."""
    out = []
    for r in rows:
        def cell(x: Any) -> str:
            return fmt.DASH if fmt.missing(x) else str(x) if r["unit"] == "text" else fmt.value(x, r["unit"])
        change = (fmt.percent((r["what_if"] - r["run"]) / r["run"], signed=True)
                  if r["unit"] not in ("text", "fraction") and r["run"] and r["what_if"] is not None
                  else fmt.DASH)
        out.append({"figure": r["figure"], SCENARIOS[0]: cell(r["measured"]), SCENARIOS[1]: cell(r["run"]),
                    SCENARIOS[2]: cell(r["what_if"]), "what-if vs run's prediction": change})
    return out


# --- charts ------------------------------------------------------------------------------------------------------
def _term_color(name: str, extra: dict[str, str]) -> str:
    if name in TERM_COLORS:
        return TERM_COLORS[name]
    return extra.setdefault(name, OTHER_COLORS[len(extra) % len(OTHER_COLORS)])


def _legend(parts: list[tuple[str, float, str]]) -> list[tuple[str, str]]:
    """(color, name) of the parts that take room, each name once, in order of appearance."""
    return list({name: (color, name) for name, value, color in parts if value > 0}.values())


def step_chart(basis: dict[str, Any], own: dict[str, Any] | None, what_if: dict[str, Any] | None) -> Chart:
    """Step time term by term, one bar per scenario (SCENARIOS) that has a figure; a black tick marks each bar's
    step time (on the measured bar it shows where the timed terms overshoot or fall short of the step)."""
    m = basis["measured"]
    extra: dict[str, str] = {}
    scenarios = [(SCENARIOS[0], "measured", m["terms"], m["step_time_s"])] if m["terms"] else []
    scenarios += [(label, "predicted", p["step"]["terms_s"], p["step"]["step_time_s"])
                  for label, p in zip(SCENARIOS[1:], (own, what_if)) if p is not None]
    bars, used = [], []
    for label, kind, terms, step in scenarios:
        parts = [(name, value, _term_color(name, extra)) for name, value in terms.items() if value >= CLOCK_NOISE_S]
        used += parts
        bars.append(Bar(label, stacked(parts, "s", kind), [(step, f"{kind} step {fmt.duration(step)}")]))
    caption = ("What to look for: which term grows or shrinks from the run's predicted layout to the what-if (the "
               "simulator's error on this run, measured vs predicted, is the error bar on the what-if); on the "
               "measured bar, the timers' split of the step on its slowest stage. The black tick is the step time.")
    return Chart(bars, "s", "time per step", "scenario", _legend(used), caption)


def memory_chart(basis: dict[str, Any], own: dict[str, Any] | None, what_if: dict[str, Any] | None) -> Chart:
    """Per stage, static + workspaces and persistent buffers (cuBLAS's, Megatron's global buffer) + activations +
    outside PyTorch against the GPU's HBM (the black tick), for the run's own layout and the what-if; the run's
    measured peak allocated (largest rank) as a bar of its own."""
    bars = []
    peak = basis["measured"]["peak_bytes"]
    if peak:
        hbm = own["hardware"]["hbm_bytes"] if own else None
        bars.append(Bar(f"{SCENARIOS[0]}, largest rank", stacked(
            [("peak allocated (measured)", peak, MEMORY_COLORS["peak allocated (measured)"])], "bytes"),
            [(hbm, f"HBM {fmt.size(hbm)}")] if hbm else []))
    for label, p in zip(SCENARIOS[1:], (own, what_if)):
        if p is None:
            continue
        hbm = p["hardware"]["hbm_bytes"]
        for s in p["memory"]["per_stage"]:
            figures = {**s, "persistent": sum(s["persistent"].values())}
            parts = [(name, figures[key], MEMORY_COLORS[name]) for name, key in
                     (("static", "static"), ("workspaces, persistent buffers", "persistent"),
                      ("activations", "activations"), ("outside PyTorch", "outside_pytorch"))]
            bars.append(Bar(f"{label}, stage {s['stage']}", stacked(parts, "bytes", label),
                            [(hbm, f"HBM of {p['hardware']['name']}: {fmt.size(hbm)}")]))
    caption = ("What to look for: a stage whose bar passes its black tick (the GPU's HBM) does not fit; the "
               "measured peak is the allocator's (without what lies outside PyTorch), to hold against static + "
               "activations of the run's predicted stages.")
    return Chart(bars, "bytes", "memory per GPU", "scenario and pipeline stage",
                 [(c, n) for n, c in MEMORY_COLORS.items()], caption)
