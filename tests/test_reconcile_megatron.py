"""A Megatron-LM run directory reconciles through the same rows: the layout runs/megatron/run.sh writes, and the one
Megatron-LM writes by itself (TensorBoard argument summaries and scalars, torch_profile/ traces; no wrapper file)."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from cli.main import main as cli
from common.arguments import build_parser, parse_args
from common.errors import InputError
from ledger.evidence.megatron.arguments import flags_from_arguments
from ledger.evidence.read import read_run
from ledger.evidence.traces import summarize
from ledger.present.loaders import list_runs
from ledger.reconcile.run import run_steps
from tests.support.recorded_runs import reconcile_recorded

REPO = Path(__file__).resolve().parent.parent

# A stand-in for Megatron-LM's pretrain_gpt.py: what the real one leaves in --tensorboard-dir with
# --log-memory-to-tensorboard --log-timers-to-tensorboard --profile --use-pytorch-profiler.
FAKE_PRETRAIN = textwrap.dedent('''
    import json, os, sys
    args = sys.argv[1:]
    tb = args[args.index("--tensorboard-dir") + 1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trace = {"distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world}, "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#%d" % s, "pid": 1, "tid": 1, "ts": s * 1000.0,
         "dur": 900.0} for s in (20, 21)]}
    with open(os.path.join(tb, "host_%d.123.pt.trace.json" % (1000 + rank)), "w") as f:
        json.dump(trace, f)
    if rank == world - 1:
        from torch.utils.tensorboard import SummaryWriter
        w = SummaryWriter(tb)
        for step in range(1, 4):
            w.add_scalar("mem-reserved-bytes", 30e9 + step * 1e6, step)
            w.add_scalar("mem-allocated-bytes", 10e9, step)
            w.add_scalar("mem-max-allocated-bytes", 20e9 + step * 1e6, step)
            w.add_scalar("iteration-time", 1.5, step)
        w.close()
''')


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    checkout = root / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text(FAKE_PRETRAIN)
    run = root / "run"
    env = dict(os.environ, MEGATRON_LM=str(checkout), NPROC="8")
    done = subprocess.run(["bash", str(REPO / "runs/megatron/run.sh"), str(run)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return run


def test_run_sh_writes_the_ingest_layout(megatron_run):
    meta = json.loads((megatron_run / "megatron_run.json").read_text())
    assert meta["framework"] == "megatron-lm" and meta["world_size"] == 8 and meta["exit_code"] == 0
    assert "--log-memory-to-tensorboard" in meta["argv"] and (megatron_run / "logs/torchrun.log").is_file()
    assert len(list((megatron_run / "tb").glob("*.pt.trace.json"))) == 8


def test_megatron_run_reconciles(megatron_run):
    result = reconcile_recorded(megatron_run)
    assert result.run["framework"] == "megatron-lm" and result.run["status"] == "complete"
    peak = [r for r in result.rows if r.metric == "memory.peak_allocated"]
    # TensorBoard stores scalars as float32: byte counts survive to about 7 significant digits
    assert [(r.rank, r.stage, pytest.approx(r.measured, rel=1e-6)) for r in peak] == [(7, 1, 20e9 + 3e6)]
    assert peak[0].predicted is not None  # the llama3.2-1b TP2 PP2 DP2 plan from Megatron's own flags
    frag = next(r for r in result.rows if r.metric == "memory.fragmentation")
    assert frag.measured == pytest.approx(10e9, rel=1e-6)  # reserved - peak of step 3, where reserved peaked
    assert any(r.metric == "throughput.tokens_per_step" and r.measured == 16 * 8192 for r in result.rows)
    assert any("Megatron-LM run" in m for m in result.missing)
    assert not any("--profile" in m for m in result.missing)  # a flag that changes no prediction is not named
    # what only this project's probes record is said once, in the Megatron-LM line, never with our flags' names
    assert not any(m.startswith(("no timing records", "no inventory", "no bandwidth sweep")) for m in result.missing)
    assert read_run(megatron_run).config.implementation.attention_backend == "flash"  # Transformer Engine's
    assert len(result.run["traces"]) == 8


# ---- Megatron-LM's own run directory (no wrapper file): TensorBoard argument summaries + torch_profile/ ----------
# The event files below are synthetic plumbing: written by tensorboard's event writer in the shape torch's
# SummaryWriter gives Megatron's add_text / add_scalar, with the arguments Megatron-LM's real parser produced for
# runs/megatron/lm_tensorboard_run.sh (tests/fixtures/megatron_lm_arguments). They test the reading, not a
# measurement; the device run's own directory is the fixture for that.

REAL_ARGUMENTS = json.loads((REPO / "tests/fixtures/megatron_lm_arguments/arguments.json").read_text())


def write_event_file(tb_dir: Path, arguments: dict[str, str], scalars: dict[str, dict[int, float]],
                     start_iteration: int = 0) -> None:
    """One launch's event file as Megatron-LM's last rank writes it: every argument as add_text(name, str(value),
    global_step=iteration) does (tag "<name>/text_summary", a DT_STRING tensor, the text plugin), then add_scalar's
    simple values."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(tb_dir))
    text = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
    for name, value in arguments.items():
        tensor = TensorProto(dtype="DT_STRING", string_val=[value.encode()],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        summary = Summary(value=[Summary.Value(tag=f"{name}/text_summary", metadata=text, tensor=tensor)])
        writer.add_event(Event(summary=summary, step=start_iteration))
    for tag, values in scalars.items():
        for step, value in sorted(values.items()):
            writer.add_event(Event(summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)]), step=step))
    writer.close()


def write_profile_trace(run: Path, rank: int, steps: range, world: int = 1) -> Path:
    """RUN/torch_profile/rank-<R>.json.gz with a distributedInfo and one ProfilerStep annotation per step."""
    folder = run / "torch_profile"
    folder.mkdir(parents=True, exist_ok=True)
    trace = {"distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world}, "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1, "ts": s * 1000.0,
         "dur": 900.0} for s in steps]}
    path = folder / f"rank-{rank}.json.gz"
    path.write_bytes(gzip.compress(json.dumps(trace).encode()))
    return path


GIB = 1 << 30


def device_run_scalars(last: int) -> dict[str, dict[int, float]]:
    """Per-iteration scalars of the device run's flags: mem-* from iteration 1, iteration-time from 2 (Megatron
    skips a launch's first iteration), a peak that grows until iteration 3."""
    its = range(1, last + 1)
    return {"mem-reserved-bytes": {i: 2.0 * GIB for i in its},
            "mem-allocated-bytes": {i: 0.25 * GIB for i in its},
            "mem-max-allocated-bytes": {i: (0.5 + 0.25 * min(i, 3)) * GIB for i in its},
            "iteration-time": {i: 0.05 for i in its if i > 1},
            "lm loss": {i: 9.0 - 0.1 * i for i in its},
            "learning-rate vs samples": {8 * i: 3e-4 for i in its}}


def own_layout_run(root: Path, last: int = 12, arguments: dict[str, str] | None = None) -> Path:
    run = root / "megatron_lm_1gpu"
    (run / "tensorboard").mkdir(parents=True)
    write_event_file(run / "tensorboard", arguments or REAL_ARGUMENTS, device_run_scalars(last))
    write_profile_trace(run, 0, range(5, 8))
    return run


def test_megatron_arguments_become_our_flags():
    """Megatron's names and derived values, from its real parser: the device run's flags come back."""
    argv, unmodelled = flags_from_arguments(REAL_ARGUMENTS, build_parser("megatron-lm"))
    assert unmodelled == []
    cfg = build_parser("megatron-lm").parse_args(argv)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads, cfg.num_query_groups,
            cfg.seq_length) == (2, 256, 1024, 4, 2, 512)
    assert cfg.vocab_size == 8064  # --vocab-size 8000, padded by Megatron to a multiple of 128
    assert cfg.norm_epsilon == 1e-5 and cfg.disable_bias_linear and cfg.swiglu  # layernorm_epsilon, add_bias_linear
    assert cfg.untie_embeddings_and_output_weights and cfg.use_distributed_optimizer and cfg.bf16
    assert (cfg.use_pytorch_profiler, cfg.profile_step_start, cfg.profile_step_end, cfg.profile_ranks) == \
        (True, 5, 8, [0])
    assert (cfg.micro_batch_size, cfg.global_batch_size, cfg.train_iters, cfg.world_size) == (2, 8, 12, 1)


@pytest.mark.parametrize("changes, named", [
    # MoE is modelled, with the alltoall dispatcher; Megatron's default dispatcher (allgather) is not.
    ({"num_experts": "8"}, ["moe_token_dispatcher_type=allgather"]),
    ({"add_qkv_bias": "True", "qk_layernorm": "True"}, ["add_qkv_bias=True", "qk_layernorm=True"]),
    ({"normalization": "RMSNormX"}, ["normalization=RMSNormX"]),
])
def test_arguments_the_formulas_do_not_model_are_named(changes, named):
    """Named, and never passed on as a flag our parser would refuse (a choice outside its list)."""
    parser = build_parser("megatron-lm", megatron_model=True)
    argv, unmodelled = flags_from_arguments({**REAL_ARGUMENTS, **changes}, parser)
    assert sorted(unmodelled) == sorted(named)
    parser.parse_args(argv)


def test_a_gpt_style_megatron_run_is_modelled_not_named():
    """Megatron's default layer (no --swiglu, biases, LayerNorm, learned positions) is the formulas' GPT flavour:
    read as Megatron reads its arguments, nothing is left unmodelled and the config carries the flavour."""
    gpt = {"swiglu": "False", "add_bias_linear": "True", "normalization": "LayerNorm",
           "position_embedding_type": "learned_absolute"}
    argv, unmodelled = flags_from_arguments({**REAL_ARGUMENTS, **gpt}, build_parser("megatron-lm", megatron_model=True))
    assert unmodelled == []
    model = parse_args(argv, megatron_model=True).model
    assert (model.swiglu, model.add_bias_linear, model.normalization, model.position_embedding_type) == \
        (False, True, "LayerNorm", "learned_absolute")


def test_query_groups_count_only_with_group_query_attention():
    """Megatron passes num_query_groups to the model only with --group-query-attention; otherwise one group per
    head."""
    argv, _ = flags_from_arguments({**REAL_ARGUMENTS, "group_query_attention": "False"}, build_parser("m"))
    assert "--num-query-groups" not in argv


def test_a_real_tokenizer_vocabulary_comes_from_the_padded_size():
    """With a real tokenizer Megatron's vocab_size argument is None; padded_vocab_size holds the vocabulary, and
    which tokenizer made it is no concern of the formulas."""
    argv, unmodelled = flags_from_arguments({**REAL_ARGUMENTS, "vocab_size": "None", "padded_vocab_size": "50304",
                                             "tokenizer_type": "HuggingFaceTokenizer"}, build_parser("m"))
    assert argv[argv.index("--vocab-size") + 1] == "50304" and unmodelled == []


def test_torch_profiler_counts_only_with_profile():
    argv, _ = flags_from_arguments({**REAL_ARGUMENTS, "profile": "False"}, build_parser("m"))
    assert "--use-pytorch-profiler" not in argv


def test_own_layout_reconciles(tmp_path):
    run = own_layout_run(tmp_path)
    result = reconcile_recorded(run)
    assert result.run["framework"] == "megatron-lm" and result.run["world_size"] == 1
    assert result.run["status"] == "complete"  # the scalars reach --train-iters 12
    assert result.run["traces"] == ["torch_profile/rank-0.json.gz"]
    peak = next(r for r in result.rows if r.metric == "memory.peak_allocated")
    assert (peak.rank, peak.measured) == (0, 1.25 * GIB)  # the last rank is rank 0 of one
    assert peak.predicted is not None  # the formulas ran on the shape recovered from the argument summaries
    assert any(r.metric == "throughput.tokens_per_step" and r.measured == 8 * 512 for r in result.rows)
    assert any("Megatron-LM run" in m for m in result.missing)
    assert not any("not modelled" in m for m in result.missing)


def test_steps_the_profiler_disturbed_are_flagged_from_megatron_schedule(tmp_path):
    """--profile-step-start 5 --profile-step-end 8: torch.profiler warms up in iteration 4, records 5-7, and exports
    the trace at the top of iteration 8."""
    selection = run_steps(read_run(own_layout_run(tmp_path)))
    assert (selection.profiled, selection.after_export) == ({4, 5, 6, 7}, {8})
    assert selection.steady(range(2, 13)) == [3, 9, 10, 11, 12]  # 2 is the first iteration with a time


def test_a_run_whose_scalars_stop_early_is_not_complete(tmp_path):
    result = reconcile_recorded(own_layout_run(tmp_path, last=7))
    assert result.run["status"] == "running"
    assert any("iteration 7 of 12" in m for m in result.missing)


def test_a_resumed_run_takes_the_last_launch_configuration(tmp_path):
    run = own_layout_run(tmp_path, last=6, arguments={**REAL_ARGUMENTS, "train_iters": "6"})
    later = {tag: {s: v for s, v in values.items() if s > 6} for tag, values in device_run_scalars(12).items()}
    write_event_file(run / "tensorboard", REAL_ARGUMENTS, later, start_iteration=6)
    ev = read_run(run)
    assert ev.config.train.train_iters == 12 and ev.manifest["status"] == "complete"
    assert [m.step for m in ev.ranks[0].memory_steps] == list(range(1, 13))
    (note,) = [m for m in ev.missing if "launches" in m]
    assert "2 launches" in note and "from iteration 6" in note and "--train-iters" in note


def test_the_dashboard_lists_the_run(tmp_path):
    run = own_layout_run(tmp_path / "runs")
    (entry,) = list_runs(str(tmp_path / "runs"))
    assert (entry["path"], entry["framework"], entry.get("error")) == (str(run), "megatron-lm", None)


def _one_line_exit_2(capsys, run: Path, *needles: str) -> None:
    assert cli(["reconcile", str(run)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert all(n in line for n in needles), line


def test_the_cli_reconciles_the_run_directory(tmp_path, capsys):
    run = own_layout_run(tmp_path)
    assert cli(["reconcile", str(run)]) == 0
    assert "megatron-lm" in capsys.readouterr().out and (run / "ledger/reconciliation.json").is_file()


def test_the_tensorboard_directory_itself_is_refused_with_a_hint(tmp_path, capsys):
    run = own_layout_run(tmp_path)
    _one_line_exit_2(capsys, run / "tensorboard", "pass the folder that holds it", "torch_profile")


def test_tensorboard_files_without_megatron_arguments_are_refused(tmp_path, capsys):
    run = tmp_path / "other"
    (run / "logs").mkdir(parents=True)
    write_event_file(run / "logs", {}, {"loss": {1: 2.0}})
    _one_line_exit_2(capsys, run, "no argument text summaries", "not a Megatron-LM TensorBoard directory")


def test_two_tensorboard_directories_are_refused(tmp_path, capsys):
    run = own_layout_run(tmp_path)
    (run / "tb2").mkdir()
    write_event_file(run / "tb2", REAL_ARGUMENTS, {})
    _one_line_exit_2(capsys, run, "2 TensorBoard directories", "tb2")


def test_a_corrupt_event_file_is_refused(tmp_path, capsys):
    """Damage inside the file (tensorboard's own loader would stop there quietly and pass it off as a short run)."""
    run = own_layout_run(tmp_path)
    event_file = next((run / "tensorboard").iterdir())
    data = bytearray(event_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    event_file.write_bytes(bytes(data))
    _one_line_exit_2(capsys, run, event_file.name, "corrupt TensorBoard event file", "fails its CRC")


def test_a_record_cut_short_at_the_end_is_skipped_and_said(tmp_path):
    """A writer killed mid-record leaves a torn tail: what precedes it is read, and the loss is named."""
    run = own_layout_run(tmp_path)
    event_file = next((run / "tensorboard").iterdir())
    event_file.write_bytes(event_file.read_bytes()[:-5])
    ev = read_run(run)
    # the last record: "learning-rate vs samples"
    assert [m.step for m in ev.ranks[0].memory_steps] == list(range(1, 13))
    assert any(event_file.name in m and "torn record" in m for m in ev.missing)


def test_a_trace_of_another_rank_is_refused(tmp_path, capsys):
    run = own_layout_run(tmp_path)
    path = run / "torch_profile/rank-0.json.gz"
    write_profile_trace(run, 3, range(5, 8), world=1).rename(path)
    _one_line_exit_2(capsys, run, "rank-0.json.gz", "distributedInfo says rank 3")


def test_a_nonpositive_world_size_is_refused(tmp_path, capsys):
    run = own_layout_run(tmp_path, arguments={**REAL_ARGUMENTS, "world_size": "0"})
    _one_line_exit_2(capsys, run, "world_size '0'")


# ---- the real run: runs/megatron/lm_tensorboard_run.sh on one H200, as Megatron-LM wrote it ------------------------
# Expectations come from the script's flags and Megatron-LM's source (write_args_to_tensorboard, the torch profiler's
# schedule, training_log), not from the run's output.

REAL_RUN = REPO / "tests/fixtures/megatron_lm_1gpu"
needs_real_run = pytest.mark.skipif(not (REAL_RUN / "tensorboard").is_dir(),
                                    reason="the device run's directory (tests/fixtures/megatron_lm_1gpu) is not here")


@needs_real_run
def test_real_run_configuration_comes_from_megatron_argument_summaries():
    ev = read_run(REAL_RUN)
    m, t, p = ev.config.model, ev.config.train, ev.config.probes
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
            m.seq_length, m.vocab_size) == (2, 256, 1024, 4, 2, 512, 8064)
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters, t.bf16, t.use_distributed_optimizer) == \
        (2, 8, 12, True, True)
    assert (p.use_pytorch_profiler, p.profile_step_start, p.profile_step_end) == (True, 5, 8)
    assert ev.world_size == 1 and ev.manifest["status"] == "complete"
    assert not any("not modelled" in m for m in ev.missing)


@needs_real_run
def test_real_run_scalars_and_trace_are_where_megatron_writes_them():
    ev = read_run(REAL_RUN)
    assert [(r, a, b, p.relative_to(REAL_RUN).as_posix()) for r, a, b, p in ev.traces] == \
        [(0, 5, 7, "torch_profile/rank-0.json.gz")]
    assert set(summarize(ev.traces[0][3]).steps) == {5, 6, 7}  # ProfilerStep#N is iteration N
    rank = ev.ranks[0]
    assert [m.step for m in rank.memory_steps] == list(range(1, 13))  # mem-* every iteration
    assert [s.step for s in rank.steps] == list(range(2, 13))  # iteration-time skips the first iteration
    peaks = [m.peak for m in rank.memory_steps]
    assert peaks == sorted(peaks)  # Megatron never resets the peak
    assert all(m.allocated <= m.peak <= m.reserved
               for m in rank.memory_steps)


@needs_real_run
def test_real_run_reconciles(tmp_path):
    result = reconcile_recorded(REAL_RUN)
    peak = next(r for r in result.rows if r.metric == "memory.peak_allocated")
    assert peak.measured is not None and peak.predicted is not None
    assert any(r.metric == "throughput.tokens_per_step" and r.measured == 8 * 512 for r in result.rows)
    assert cli(["reconcile", str(REAL_RUN), "--out", str(tmp_path)]) == 0


def test_a_real_runs_ranges_without_timers_say_they_are_not_measured():
    """Priced from the H200 file, the per-range rows of a Megatron-LM run (which has no per-range timers) are
    predicted and not measured, and say so: they said "median of 0 timer range(s), steps " over no steps."""
    from ledger.models.simulate.hardware import load_hardware
    from ledger.reconcile.time_rows import TimeSources

    run = REPO / "tests/fixtures/megatron_lm_h200/sdpa_l4_mbs2"
    rows = reconcile_recorded(run, sources=TimeSources(hardware=load_hardware("H200"))).rows
    timed = [r for r in rows if r.metric in ("time.forward_per_microbatch", "time.optimizer_step")]
    assert len(timed) == 2 and all(r.measured is None and r.predicted is not None for r in timed)
    assert all("not measured: the run recorded no" in r.explanation and "median of 0" not in r.explanation
               for r in timed)


def test_megatrons_timers_are_judged_against_the_time_model(tmp_path):
    """--timing-log-level 2 --log-timers-to-tensorboard: "<timer>-time" scalars, seconds per iteration. Priced from
    the H200 hardware file (no sweep in a Megatron-LM run), forward-compute is m forward passes, backward-compute m
    backward passes, optimizer the optimizer range, forward-backward the step without the optimizer and memset;
    a timer the model does not price apart is shown measured only. Synthetic plumbing: the values are the
    prediction x 1.02 (ok) and x 2 (off)."""
    from ledger.models.simulate.hardware import load_hardware
    from ledger.reconcile.time_rows import TimeSources, predict_run

    sources = TimeSources(hardware=load_hardware("H200"))
    ev = read_run(own_layout_run(tmp_path / "probe"))
    model = predict_run(ev, sources)
    stage, m = model.step.stages[0], ev.config.num_microbatches
    timers = {"forward-compute": 1.02 * m * stage.compute.forward, "backward-compute": 2 * m * stage.compute.backward,
              "optimizer": 1.02 * stage.optimizer, "optimizer-inner-step": 0.01}
    run = tmp_path / "timed" / "megatron_lm_1gpu"
    (run / "tensorboard").mkdir(parents=True)
    scalars = {**device_run_scalars(12), **{f"{k}-time": dict.fromkeys(range(2, 13), v) for k, v in timers.items()},
               "throughput": dict.fromkeys(range(2, 13), 1.0)}
    write_event_file(run / "tensorboard", REAL_ARGUMENTS, scalars)
    write_profile_trace(run, 0, range(5, 8))
    rows = {r.metric: r for r in reconcile_recorded(run, sources=sources).rows if r.metric.startswith("megatron.")}
    assert rows["megatron.timer.forward-compute"].verdict == "ok"
    assert rows["megatron.timer.forward-compute"].predicted == pytest.approx(m * stage.compute.forward)
    assert rows["megatron.timer.backward-compute"].verdict == "off"
    assert rows["megatron.timer.optimizer"].verdict == "ok"
    assert rows["megatron.timer.optimizer-inner-step"].predicted is None  # measured only
    assert rows["megatron.throughput"].predicted is not None and "megatron.flops_per_step" in rows


def test_megatrons_flop_count_is_the_ledgers():
    """The H200 run's throughput scalar x iteration time is Megatron's num_floating_point_operations for a step:
    the ledger's count of the same convention agrees to the float32 the scalar was stored in."""
    result = reconcile_recorded(REPO / "tests/fixtures/megatron_lm_1gpu")
    (flops,) = [r for r in result.rows if r.metric == "megatron.flops_per_step"]
    assert abs(flops.rel_diff) < 1e-6 and flops.verdict == "ok"


def test_export_trace_merges_the_h200_megatron_run(tmp_path):
    """Megatron-LM writes no manifest: export-trace takes the rank from the trace's distributedInfo and names the
    process by its coordinates; the memory scalars become counter tracks."""
    out = tmp_path / "merged.json.gz"
    assert cli(["export-trace", str(REPO / "tests/fixtures/megatron_lm_1gpu"), "--out", str(out)]) == 0
    events = json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    names = [e["args"]["name"] for e in events if e.get("name") == "process_name"]
    assert names == ["rank 0 (tp0 dp0 pp0)"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#5", "ProfilerStep#6", "ProfilerStep#7"}
    counters = [e for e in events if e.get("ph") == "C" and e.get("name") == "memory (bytes)"]
    assert len(counters) == 3 and all(c["args"]["peak"] == 274_331_136 for c in counters)  # one per step


def test_export_trace_merges_every_rank_of_a_megatron_run(megatron_run, tmp_path):
    """run.sh's layout: eight traces in the TensorBoard directory, each rank from its distributedInfo (synthetic
    plumbing: the stand-in pretrain_gpt.py's traces)."""
    out = tmp_path / "merged.json.gz"
    assert cli(["export-trace", str(megatron_run), "--out", str(out)]) == 0
    events = json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    names = sorted(e["args"]["name"] for e in events if e.get("name") == "process_name")
    assert len(names) == 8 and names[0].startswith("rank 0 (") and names[-1].startswith("rank 7 (")


def test_a_trace_named_for_another_rank_is_refused(tmp_path):
    run = own_layout_run(tmp_path)
    (run / "torch_profile/rank-0.json.gz").rename(run / "torch_profile/rank-3.json.gz")
    with pytest.raises(InputError, match="distributedInfo says rank 0"):
        read_run(run)
