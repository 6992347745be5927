"""The hardware files (ledger/models/hardware/*.json) and their loader (ledger/models/simulate/hardware.py).

Each known GPU kind loads by name, case-insensitive, or by path; every number in a file says where it comes from
(the H200's efficiency blocks: our own grid sweep of kernel timings on one H200, equal to its fit;
the other kinds: datasheets, and assumptions labelled as such); a bad file or name is refused with one line.
"""
from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest

from common.arguments import parse_args
from common.errors import ConfigError
from common.ops.host import GRAPH_PRIMITIVES, HOST_PRIMITIVES
from common.ops.kernel import Kernel, passes
from common.ops.linear import gemm
from common.ops.traffic import bytes_moved
from ledger.evidence.run import collect_run
from ledger.models.simulate.fit import fit_hardware
from ledger.models.simulate.hardware import HARDWARE_DIR, load_hardware
from ledger.models.simulate.kernel_cost import attention_seconds, kernel_seconds, memory_seconds
from ledger.models.simulate.simulation import simulate
from tests.support.bench import bench_script
from tests.support.recorded_runs import FIXTURES

FILES = {"H200": "h200.json", "H100": "h100.json", "A100-80GB": "a100-80gb.json", "A100-40GB": "a100-40gb.json"}
ROOT = Path(__file__).resolve().parents[1]
CALIBRATION_DIR = ROOT / "ledger/models/calibration"
GRID_SWEEPS = {name: [ROOT / "runs/bench/results" / f for f in files] for name, files in {
    "H200": ("2026-12-01_h200_hardware_sweep.json.gz", "2026-12-01_h200_hardware_sweep_mbs.json.gz",
             "2026-12-02_h200_hardware_sweep_megatron.json.gz", "2026-12-04_h200_hardware_sweep_moe.json.gz",
             "2026-12-05_h200_hardware_sweep_short_attention.json.gz"),
    "H100": tuple(f"2026-12-05_h100_hardware_sweep{part}.json.gz"
                  for part in ("", "_mbs", "_short_attention", "_moe", "_experts", "_megatron"))}.items()}
DEVICES = {"H200": "NVIDIA H200", "H100": "NVIDIA H100 80GB HBM3"}
H200_RUNS = [FIXTURES / "h200_llama1b" / n for n in ("s4096", "s8192", "s8192-selective", "s8192-full",
                                                      "8b-4layers")] + [FIXTURES / "h200_2layer_profiled"]
FITTED = ("gemm", "attention", "memory_bound", "sustained")


def raw(name: str) -> dict:
    return json.loads((HARDWARE_DIR / FILES[name]).read_text())


def raw_calibration(name: str) -> dict:
    return json.loads((CALIBRATION_DIR / f"{name}.json").read_text())


@pytest.mark.parametrize("spec", ["H200", "h200", "H100", "a100-80gb", "A100-40GB", "A100-80Gb"])
def test_every_known_kind_loads_by_name_whatever_the_case(spec):
    hw = load_hardware(spec)
    assert hw.name.lower() == spec.lower()
    assert hw.gpus_per_node == 8 and hw.hbm_bytes > 0 and hw.peak("bf16") > 0


def test_a_file_loads_by_path(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(raw("H100")))
    assert load_hardware(str(path)).hbm_bandwidth == load_hardware("H100").hbm_bandwidth


def test_the_datasheet_figures_are_the_public_ones():
    h100, a80, a40, h200 = (load_hardware(n) for n in ("H100", "A100-80GB", "A100-40GB", "H200"))
    assert h100.peak("bf16") == h200.peak("bf16") == 989e12 and a80.peak("bf16") == a40.peak("bf16") == 312e12
    assert (h200.hbm_bandwidth, h100.hbm_bandwidth, a80.hbm_bandwidth, a40.hbm_bandwidth) == (
        4.8e12, 3.35e12, 2.039e12, 1.555e12)
    assert (a80.hbm_bytes, a40.hbm_bytes) == (80 * 2 ** 30, 40 * 2 ** 30)
    # NVML's total on our H100 (the datasheet's 80 GB) less what the driver keeps is CUDA's total_memory in its runs
    assert h100.hbm_bytes - raw_calibration("nvidia_h100_80gb_hbm3")["driver_reserved"] == \
        collect_run(FIXTURES / "h100_new_shapes" / "h1_llama1b_s4096").manifest["ranks"][0]["device"]["total_bytes"]
    # 400 Gb/s NDR a GPU on DGX H100 / H200, 200 Gb/s HDR on DGX A100
    assert h200.nic_bandwidth == h100.nic_bandwidth == 400e9 / 8 and a80.nic_bandwidth == 200e9 / 8


def numbers_without_source(node, path: str = "", sourced: bool = False) -> list[str]:
    """Paths of numbers with no "source" on their object or any object above them."""
    if isinstance(node, dict):
        sourced = sourced or isinstance(node.get("source"), str) and bool(node["source"].strip())
        return [p for k, v in node.items() for p in numbers_without_source(v, f"{path}.{k}", sourced)]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in numbers_without_source(v, f"{path}[{i}]", sourced)]
    is_number = isinstance(node, (int, float)) and not isinstance(node, bool)
    return [path] if is_number and not sourced and path != ".schema_version" else []


@pytest.mark.parametrize("name", FILES)
def test_every_number_carries_its_source(name):
    assert numbers_without_source(raw(name)) == []


def test_the_h200_and_h100_curves_come_from_our_sweeps_and_the_others_say_they_are_assumed():
    h200 = raw("H200")
    for name in ("H200", "H100"):
        for block in FITTED:
            assert "runs/bench/hardware_fit.py" in raw(name)[block]["source"]
            assert "kernel records only" in raw(name)[block]["source"]
    assert raw("H100")["outside_pytorch"]["source"].startswith("measured")
    for name in ("A100-80GB", "A100-40GB"):
        d = raw(name)
        for block in FITTED:
            assert d[block]["source"].startswith("assumption: the H200 fit")
            assert {k: v for k, v in d[block].items() if k != "source"} == \
                {k: v for k, v in h200[block].items() if k != "source"}
        assert "datasheet" in d["peak_flops"]["bf16"]["source"] and "datasheet" in d["hbm_bandwidth"]["source"]
        assert d["outside_pytorch"]["source"].startswith("assumption")
    assert "assumption" in h200["inter_node"]["nic_bandwidth"]["source"]  # one node here: not measurable
    assert h200["intra_node"]["p2p_bandwidth"]["source"].startswith("measured")


def close(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == pytest.approx(b, rel=1e-3, abs=1e-12)


@pytest.mark.parametrize("name", ["H200", "H100"])
def test_a_measured_file_is_the_fit_of_its_committed_grid_sweeps_alone(name):
    # Fitted from runs/bench/hardware_sweep.py's grid of kernel timings only, on one GPU of the kind: no record of the
    # runs it is validated on goes in (not even their own compute sweeps), so no run's step time can leak into the
    # curves.
    d = raw(name)
    sweeps = [ROOT / s for s in d["gemm"]["source"].split("--sweeps ")[1].split(" --sweeps-only")[0].split()]
    assert sweeps == GRID_SWEEPS[name]
    records = [r for sweep in sweeps for r in json.load(gzip.open(sweep, "rt"))["records"]]
    assert records and {r["device"] for r in records} == {DEVICES[name]}
    fit = fit_hardware(records, peak=d["peak_flops"]["bf16"]["value"], hbm_bandwidth=d["hbm_bandwidth"]["value"])
    assert close(fit.gemm, {k: d["gemm"][k] for k in fit.gemm})
    assert close(fit.sustained, {k: d["sustained"][k] for k in fit.sustained})
    assert close(fit.memory, {k: d["memory_bound"][k] for k in fit.memory})
    for pass_ in ("fwd", "bwd"):
        fitted = {str(d): {str(seq): pts for seq, pts in by_seq.items()} for d, by_seq in fit.attention[pass_].items()}
        assert close(fitted, d["attention"][pass_]["by_head_dim"])


# ---- refused, with one line naming the problem ----------------------------------------------------------------

def refused(spec: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_hardware(spec)
    message = str(info.value)
    assert "\n" not in message
    return message


def broken(tmp_path: Path, change) -> str:
    d = copy.deepcopy(raw("H200"))
    change(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    return str(path)


def test_an_unknown_name_is_refused_naming_the_known_ones():
    message = refused("B200")
    assert "unknown hardware 'B200'" in message and "H200, H100, A100-80GB, A100-40GB" in message


def test_a_missing_file_is_refused(tmp_path):
    assert "does not exist" in refused(str(tmp_path / "nowhere.json"))


def test_malformed_json_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"name": "H200",')
    message = refused(str(path))
    assert str(path) in message and "not valid JSON" in message


def test_a_json_list_is_refused(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert "must hold a JSON object" in refused(str(path))


@pytest.mark.parametrize("field, change, expected", [
    ("hbm_bandwidth", lambda d: d.pop("hbm_bandwidth"), "hbm_bandwidth is missing"),
    ("inter_node.nic_bandwidth", lambda d: d["inter_node"].pop("nic_bandwidth"), "inter_node.nic_bandwidth is missing"),
    ("gemm.compute_efficiency", lambda d: d["gemm"].pop("compute_efficiency"), "gemm.compute_efficiency is missing"),
    ("peak_flops.bf16 source", lambda d: d["peak_flops"]["bf16"].pop("source"), "peak_flops.bf16 has no source"),
    ("gemm source", lambda d: d["gemm"].pop("source"), "gemm has no source"),
    ("hbm_bandwidth zero", lambda d: d["hbm_bandwidth"].update(value=0), "hbm_bandwidth must be positive, got 0"),
    ("peak negative", lambda d: d["peak_flops"]["bf16"].update(value=-1.0),
     "peak_flops.bf16 must be positive, got -1.0"),
    ("gpus_per_node zero", lambda d: d["gpus_per_node"].update(value=0), "gpus_per_node must be positive"),
    ("gpus_per_node fraction", lambda d: d["gpus_per_node"].update(value=7.5), "must be an integer"),
    ("efficiency zero", lambda d: d["memory_bound"]["efficiency_by_kernel"].update(residual_add=0),
     "memory_bound.efficiency_by_kernel.residual_add must be positive"),
    ("efficiency above 1", lambda d: d["gemm"].update(compute_efficiency=1.5),
     "gemm.compute_efficiency must be at most"),
    ("curve point", lambda d: d["attention"]["fwd"]["by_head_dim"]["64"]["2048"].append([-1, 0.5]),
     "attention.fwd.by_head_dim.64.2048 must be positive"),
    ("latency negative", lambda d: d["nccl_protocols"]["ll"].update(base_s=-1e-6),
     "nccl_protocols.ll.base_s must be positive"),
    ("communicator text", lambda d: d["outside_pytorch"].update(nccl_communicator="389 MiB"), "must be a number"),
    ("schema", lambda d: d.update(schema_version=2), "schema_version is 2"),
    ("host source", lambda d: d["host"].pop("source"), "host has no source"),
    ("host primitive", lambda d: d["host"]["seconds"].pop("item"), "host.seconds has no item"),
    ("host profiled primitive", lambda d: d["host"]["profiled_seconds"].pop("compiled"),
     "host.profiled_seconds has no compiled"),
    ("host negative", lambda d: d["host"]["seconds"].update(eager=-1e-6), "host.seconds.eager must be non-negative"),
    ("host table", lambda d: d["host"].update(seconds=[1e-6]), "host.seconds must map each host primitive"),
    ("host cpu", lambda d: d["host"].pop("cpu"), "host.cpu must name the host's CPU model"),
    ("host latency", lambda d: d["host"].update(launch_latency_s=0), "host.launch_latency_s must be positive"),
    ("routing fixed negative", lambda d: d["memory_bound"]["fixed_s_by_kernel"].update({"moe.permute.fwd": -1e-6}),
     "memory_bound.fixed_s_by_kernel.moe.permute.fwd must be non-negative"),
    ("routing fixed table", lambda d: d["memory_bound"].update(fixed_s_by_kernel=[1e-6]),
     "memory_bound.fixed_s_by_kernel must map kernel names to seconds"),
    ("power threshold above 1", lambda d: d["power_limit"].update(threshold_share=1.5),
     "power_limit.threshold_share must be at most"),
    ("power threshold zero", lambda d: d["power_limit"].update(threshold_share=0), "power_limit.threshold_share must"),
    ("power source", lambda d: d["power_limit"].pop("source"), "power_limit has no source"),
    ("grouped slowdown zero", lambda d: d["grouped_gemm"].update(slowdown=0), "grouped_gemm.slowdown must be positive"),
    ("grouped slowdown text", lambda d: d["grouped_gemm"].update(slowdown="9%"), "grouped_gemm.slowdown must be a"),
    ("grouped source", lambda d: d["grouped_gemm"].pop("source"), "grouped_gemm has no source"),
    ("contexts not a block", lambda d: d["host"].update(engine_contexts=1.4), "host.engine_contexts must hold"),
    ("contexts unsourced", lambda d: d["host"].update(engine_contexts={"forward": 1.4, "backward": 1.0}),
     "host.engine_contexts must hold"),
    ("backward context zero",
     lambda d: d["host"].update(engine_contexts={"forward": 1.4, "backward": 0, "source": "x"}),
     "host.engine_contexts.backward must be positive"),
    ("megatron context unsourced", lambda d: d["host"].update(megatron_context={"value": 0.9}),
     "host.megatron_context has no source"),
    ("megatron context zero", lambda d: d["host"].update(megatron_context={"value": 0, "source": "x"}),
     "host.megatron_context must be positive"),
    ("megatron context text", lambda d: d["host"].update(megatron_context="0.9"), "host.megatron_context must be an"),
])
def test_a_bad_field_is_refused_with_one_line_naming_it(tmp_path, field, change, expected):
    path = broken(tmp_path, change)
    message = refused(path)
    assert expected in message and path in message


def test_the_h200_file_prices_the_host_and_says_from_which_runs_the_a100s_have_none():
    # The host block is a stand-in estimated from the calibration run's trace until the host sweep of
    # runs/bench/host_sweep_h200.sh replaces it, with the graph primitives a host sweep timed alone (no training
    # run); the kinds never measured have none (the host timeline is off there).
    host = load_hardware("H200").host
    assert set(host.seconds) == set(HOST_PRIMITIVES) | set(GRAPH_PRIMITIVES) and host.has_profiled
    assert all(host.profiled[k] >= host.seconds[k] for k in host.seconds)  # the profiler only adds
    source = raw("H200")["host"]["source"]
    assert "runs/bench/host_block.py --traces" in source and "h200_2layer_profiled" in source
    assert "host sweep alone" in raw("H200")["host"]["graphs_source"]
    assert all(load_hardware(name).host is None for name in ("A100-80GB", "A100-40GB"))


def test_the_h100_host_block_is_the_estimate_from_its_calibration_runs_trace():
    # Re-derived from the committed calibration run (its profiled steps) and the host sweep's graph primitives: the
    # block in the file is exactly that, with the launch latency measured in the same trace (the H100's host launches
    # about 1 us before its kernel starts on an idle device).
    script = bench_script("host_block")
    run = FIXTURES / "h100_host_calibration" / "l2_s1024"
    graphs_path = ROOT / "runs/bench/results/2026-12-05_h100_host_sweep.jsonl"
    graphs = script.sweep_records(graphs_path)
    block = script.with_graphs(script.from_traces([run], "H100", "Intel(R) Xeon(R) Processor"), graphs, graphs_path)
    # the two contexts are fits against this block, written after it (host_contexts.py, host_model.py --write)
    stored = {k: v for k, v in raw("H100")["host"].items() if k not in ("engine_contexts", "megatron_context")}
    assert close(block, stored)
    assert 0.9e-6 < stored["launch_latency_s"] < 1.1e-6 and "l2_s1024" in stored["launch_latency_source"]
    host = load_hardware("H100").host
    assert set(host.seconds) == set(HOST_PRIMITIVES) | set(GRAPH_PRIMITIVES)
    assert all(host.profiled[k] >= host.seconds[k] for k in host.seconds)


def test_a_file_without_a_host_block_is_simulated_on_the_device_alone_and_says_so():
    cfg = parse_args(["--model", "llama3.2-1b", "--num-layers", "2", "--seq-length", "1024", "--bf16",
                      "--global-batch-size", "4", "--world-size", "1"])
    step = simulate(cfg, load_hardware("A100-80GB")).step
    assert step.decompositions == {} and any("host timeline off" in n and "no host block" in n for n in step.notes)


def test_a_fixed_cost_may_be_zero_but_not_negative(tmp_path):
    assert load_hardware(broken(tmp_path, lambda d: d["gemm"].update(fixed_s=0))).gemm.fixed_s == 0
    assert "gemm.fixed_s must be non-negative" in refused(broken(tmp_path, lambda d: d["gemm"].update(fixed_s=-1)))


def test_the_power_limits_threshold_is_each_gpus_measurement_and_optional(tmp_path):
    # runs/bench/sustained_split.py on one GPU of the kind: the share below which it stays under its power limit, the
    # mean over five layer shapes (the H200's 0.606-0.680, the H100's 0.546-0.676 in its raw output); the A100s assume
    # the H200's. A file without the block prices every step at the full-load factor, as before it was measured.
    raw_h100 = (ROOT / "runs/bench/results/2026-12-05_sustained_split_h100.txt").read_text()
    shares = [float(line.rsplit(" ", 1)[1]) for line in raw_h100.splitlines() if "-> threshold share" in line]
    assert len(shares) == 5 and load_hardware("H100").sustained.threshold_share == round(sum(shares) / 5, 3) == 0.619
    for name in ("H200", "A100-80GB", "A100-40GB"):
        assert load_hardware(name).sustained.threshold_share == 0.636
    for name in ("H200", "H100"):
        assert "sustained_split.py" in raw(name)["power_limit"]["source"]
    without = broken(tmp_path, lambda d: d.pop("power_limit"))
    assert load_hardware(without).sustained.threshold_share is None


def test_a_grouped_gemm_is_the_dense_gemm_of_its_total_shape_times_the_measured_slowdown(tmp_path):
    # The H200 file's slowdown is torch._grouped_mm over one dense mm of the same m, n, k, timed side by side on the
    # device (runs/bench/grouped_gemm_slowdown.py: 1.079 and 1.102 in two calls); the per-expert wgrads are plain
    # GEMMs and keep the dense price, and a file without the block prices grouped GEMMs as dense.

    h200 = load_hardware("H200")
    assert h200.gemm.grouped_slowdown == pytest.approx((1.0794 + 1.1018) / 2, abs=1e-4)
    grouped = gemm("experts.linear_fc1.fprop", 8192, 28672, 4096, experts=8)
    dense = gemm("linear_fc1.fprop", 8192, 28672, 4096)
    assert kernel_seconds(h200, grouped, "bf16", "fp32") == pytest.approx(
        h200.gemm.grouped_slowdown * kernel_seconds(h200, dense, "bf16", "fp32"), rel=1e-12)
    without = load_hardware(broken(tmp_path, lambda d: d.pop("grouped_gemm")))
    assert without.gemm.grouped_slowdown == 1.0
    assert kernel_seconds(without, grouped, "bf16", "fp32") == kernel_seconds(without, dense, "bf16", "fp32")
    assert all(load_hardware(name).gemm.grouped_slowdown == 1.0 for name in ("H100", "A100-80GB", "A100-40GB"))


def test_the_grouped_slowdown_is_the_mean_of_the_committed_side_by_side_timings():
    script = bench_script("grouped_gemm_slowdown")
    tables = script.calls(script.RESULTS[0].read_text())
    assert len(tables) == 2  # two device calls, the second with the experts' rows spread +-120
    grouped_ms = sum(tables[0][(g, script.GROUPED)] for g in ("fc1 forward", "fc2 forward", "fc1 dgrad"))
    assert grouped_ms == pytest.approx(2.848 + 1.616 + 3.078)  # the first call's grouped column, read back
    assert raw("H200")["grouped_gemm"]["slowdown"] == round(sum(map(script.slowdown, tables)) / 2, 4)


def test_megatrons_fused_softmax_moves_the_scores_once_each_way_at_a_row_norms_efficiency():
    # Megatron's fused scale-mask-softmax (never swept here: it needs Megatron's CUDA extension) is priced by what it
    # must move, E elements of the score matrix in 16 bits: forward the scores read and the probabilities written
    # (2 x 2 bytes an element), backward the probabilities and their gradient read and one gradient written (3 x 2),
    # at the efficiency of a row-wise reduction and scale (rms_norm's), where torch's chain (masked_fill_, softmax)
    # moves 4 x 2 + 1 and 14 x 2 + 1 bytes an element.

    h200, e = load_hardware("H200"), 32 * 2048 * 2048
    fused = passes("core_attention.softmax_fused", elements=e)
    chain = passes("core_attention.softmax", elements=e, fp32=0)
    assert bytes_moved(fused.fwd, 2, 4) == 2 * 2 * e and bytes_moved(fused.bwd, 2, 4) == 3 * 2 * e
    assert bytes_moved(chain.fwd, 2, 4) == (4 * 2 + 1) * e and bytes_moved(chain.bwd, 2, 4) == (14 * 2 + 1) * e
    for kernel, norm in ((fused.fwd, "rms_norm.fwd"), (fused.bwd, "rms_norm.bwd")):
        assert kernel_seconds(h200, kernel, "bf16", "fp32") == pytest.approx(
            h200.memory.fixed(kernel.name) + bytes_moved(kernel, 2, 4) / (h200.hbm_bandwidth
                                                                          * h200.memory.efficiency(norm, None)))
    assert kernel_seconds(h200, fused.bwd, "bf16", "fp32") < memory_seconds(h200, chain.bwd.name, 29 * e)


@pytest.mark.parametrize("name", ["H200", "H100"])
def test_torchs_masked_softmax_is_priced_per_precision_as_the_sweep_timed_each(name):
    """Megatron-LM's unfused softmax in 16 bits (an in-place masked_fill_ broadcasting the [b, 1, s, s] mask, then a
    16-bit softmax) and in fp32 (--attention-softmax-in-fp32: vectorised casts around fp32 kernels) are different
    kernels per byte: the file fits each its own efficiency (common/ops/traffic.py cost_name). Each GPU's sweep's two
    forward records at seq 4096 (llama3.2-1b, micro-batch 1 in 16 bits, 2 in fp32) are each priced within 5%; at the
    fp32 chain's efficiency the 16-bit one, what Megatron-LM's local runs run, would be priced 33-40% short (the
    H100's sweep, made after the split was written from the H200's, shows it too)."""
    hw = load_hardware(name)
    (megatron,) = [f for f in GRID_SWEEPS[name] if f.name.endswith("_megatron.json.gz")]
    records = json.loads(gzip.decompress(megatron.read_bytes()))["records"]
    at_4096 = {r["dims"]["fp32"]: r for r in records if r["op"] == "core_attention.softmax.fwd"
               and r["shape"].startswith("llama3.2-1b tp1 s4096")}
    assert sorted(at_4096) == [0, 1]
    for r in at_4096.values():
        chain = passes("core_attention.softmax", **r["dims"]).fwd
        assert kernel_seconds(hw, chain, "bf16", "fp32") == pytest.approx(r["seconds"], rel=0.05)
    sixteen_bit = passes("core_attention.softmax", **at_4096[0]["dims"]).fwd
    at_fp32s = memory_seconds(hw, "core_attention.softmax_fp32.fwd", bytes_moved(sixteen_bit, 2, 4))
    assert at_fp32s < 0.7 * at_4096[0]["seconds"]


def test_the_slowdown_script_refuses_a_missing_file_or_one_without_a_table_in_one_line(tmp_path, capsys):
    script = bench_script("grouped_gemm_slowdown")
    empty = tmp_path / "empty.txt"
    empty.write_text("no table here\n")
    for path in (tmp_path / "absent.txt", empty):
        assert script.main(["--results", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("grouped_gemm_slowdown: "), err


def test_the_h200_fit_refuses_a_sweep_of_another_device_or_no_sweep_in_one_line(tmp_path, capsys):
    # A CPU's sweep (hardware_sweep.py runs anywhere) fitted into the H200's curves would price the H200 at a CPU's
    # attention; an unreadable file is refused the same way, before anything is fitted or written
    script = bench_script("hardware_fit")
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"device": "cpu x86_64", "records": []}))
    garbled = tmp_path / "garbled.json.gz"
    garbled.write_bytes(b"not gzip")
    before = (HARDWARE_DIR / "h200.json").read_text()
    for path in (cpu, garbled, tmp_path / "absent.json"):
        assert script.main(["--write", "--sweeps", str(path), "--sweeps-only"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"hardware_fit: {path}: "), err
    assert (HARDWARE_DIR / "h200.json").read_text() == before
    # an H200's sweep for the H100's file
    h100 = (HARDWARE_DIR / "h100.json").read_text()
    sweep = str(GRID_SWEEPS["H200"][0])
    assert script.main(["--gpu", "H100", "--write", "--sweeps", sweep, "--sweeps-only"]) == 2
    assert capsys.readouterr().err.strip() == f"hardware_fit: {sweep}: timed on 'NVIDIA H200', not an H100"
    assert (HARDWARE_DIR / "h100.json").read_text() == h100


def test_flash_attention_at_a_launch_bound_sequence_is_priced_from_the_short_sequence_grid():
    # Below seq 2048 the file once had no curve and priced seq 512 at the seq-2048 one: 3.7 us forward and 11.3 us
    # backward for lb_h1024_l4_s512's attention (batch 2 x 16 heads, head dim 64), a third of what the kernel takes.
    # The short-sequence grid (hardware_sweep.py --short-attention, 2026-12-05) gives it curves of its own; the run's
    # own sweep, timed on another lease three days before and never fitted, agrees within 3%.
    run = FIXTURES / "h200_launch_bound" / "lb_h1024_l4_s512"
    swept = {r.op: r for rank in collect_run(run).ranks.values() for r in rank.compute if r.op.startswith("core_")}
    h200 = load_hardware("H200")
    for name, record in swept.items():
        kernel = Kernel(name, dims=tuple(sorted(record.dims.items())), flops=record.flops)
        assert record.dims["seq"] == 512
        assert attention_seconds(h200, kernel, "bf16") == pytest.approx(record.seconds, rel=0.03)
