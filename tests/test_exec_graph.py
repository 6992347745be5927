"""The execution graph (ledger.evidence.exec_graph): what it links, checked on the committed real traces where the
claim is about what torch.profiler records (launches, syncs, cross-stream waits, P2P kernels of two ranks), and on
hand-written traces (tests/support/kineto.py) for the plumbing (flows, event syncs, NCCL matching)."""
from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from ledger.evidence.exec_graph import CollectiveId, match_collectives, read_graph
from ledger.evidence.traces import summarize
from tests.support.kineto import gpu, host, launch, runtime, step, write_trace

FIXTURES = Path(__file__).parent / "fixtures"
H200_2LAYER = FIXTURES / "h200_2layer_profiled/traces/rank0.step4-5.json.gz"
H200_L2 = FIXTURES / "gpu_h200_llama1b_l2/traces/rank0.step3-4.json.gz"
MEGATRON = FIXTURES / "megatron_lm_1gpu/torch_profile/rank-0.json.gz"
PP2_SLICE = [FIXTURES / f"h200_pp2_p2p_slice/rank{r}.json.gz" for r in (0, 1)]
GPU_TRACES = [H200_2LAYER, H200_L2, MEGATRON]


def _categories(path: Path) -> Counter:
    """The trace's complete events by category, counted from the whole document (independently of the reader)."""
    with gzip.open(path, "rt") as f:
        return Counter(e.get("cat") for e in json.load(f)["traceEvents"] if e.get("ph") == "X")


@pytest.mark.parametrize("path", GPU_TRACES, ids=lambda p: p.parts[-3])
def test_every_gpu_op_of_a_real_trace_is_on_its_stream_and_linked_to_the_call_that_enqueued_it(path: Path):
    g = read_graph(path)
    cats = _categories(path)
    ops = list(g.gpu_ops())
    assert Counter(op.kind for op in ops) == {"kernel": cats["kernel"], "memcpy": cats["gpu_memcpy"],
                                               "memset": cats["gpu_memset"]}
    assert g.unlinked == 0
    assert all(op.launch.correlation == op.correlation and op.launch.start <= op.start for op in ops)
    for ops_on_stream in g.streams.values():  # a stream runs its work one op after another
        assert all(a.start <= b.start and a.end <= b.start + 1 for a, b in zip(ops_on_stream, ops_on_stream[1:]))


@pytest.mark.parametrize("path", GPU_TRACES + PP2_SLICE, ids=lambda p: "/".join(p.parts[-3:]))
def test_the_step_windows_are_the_profiler_step_annotations(path: Path):
    assert {n: (op.start, op.end) for n, op in read_graph(path).steps.items()} == summarize(path).steps


def test_each_blocking_stream_sync_of_the_h200_run_returns_just_after_the_op_inferred_for_it():
    # The H200 run ends each step with a cudaStreamSynchronize that blocks ~4.4 ms: if the op inferred for it (the
    # last one enqueued on the stream of the thread's last launch) is right, it ends just before the call returns.
    g = read_graph(H200_2LAYER)
    blocking = [s for s in g.syncs if s.call.end - s.call.start > 1000]
    assert [s.kind for s in blocking] == ["stream"] * 3
    for s in blocking:
        (awaited,) = s.awaited
        assert 0 <= s.call.end - awaited.end <= 20  # µs: the host's wake-up (measured: 8-9)


def test_the_megatron_side_stream_waits_are_inferred_and_each_is_causal():
    # Megatron-LM runs 180 kernels on a second stream (20), each after a cudaStreamWaitEvent on the compute stream's
    # event: the inference must find those waits, and an awaited op must end before its waiting stream's next op.
    g = read_graph(MEGATRON)
    assert Counter((w.stream, w.awaited.stream) for w in g.waits) == {(20, 7): 180, (7, 20): 11}
    for w in g.waits:
        first = min((op for op in g.streams[w.stream] if op.enqueued >= w.call.start), key=lambda op: op.enqueued)
        assert w.awaited.end <= first.start
    assert Counter(s.kind for s in g.syncs) == {"stream": 135, "device": 7, "copy": 6}
    assert all("DtoH" in s.awaited[0].name for s in g.syncs if s.kind == "copy")
    assert Counter(op.name for op in g.reads) == {"aten::item": 291, "aten::_local_scalar_dense": 291}
    assert len(g.data_waits) == 12 and all(op.name.startswith("enumerate(DataLoader)#") for op in g.data_waits)


def test_the_two_ranks_p2p_kernels_match_in_order_and_each_pair_ends_together():
    # The PP2 slice's SendRecv kernels carry no group or sequence number: matched by order, both sides of one
    # transfer finish together. The first pair never ran at once (rank 0's ended 8.5 ms before rank 1's began):
    # no transfer between them, dropped.
    graphs = [read_graph(p) for p in PP2_SLICE]
    items = [(g.rank, op.collective, op.start, op.end, op) for g in graphs for op in g.gpu_ops()]
    assert len(items) == 72 and all(op.collective.p2p and op.collective.seq is None for *_, op in items)
    pairs = match_collectives(items)
    assert len(pairs) == 35
    assert max(abs(a.end - b.end) for a, b in pairs) <= 16


# --- plumbing, on hand-written traces -------------------------------------------------------------------------
def test_a_stream_wait_is_inferred_from_the_issuing_threads_launches(tmp_path: Path):
    events = [step(1, 0, 200), *launch(1, 10, 20, 50, stream=7), runtime("cudaEventRecord", 16, 1),
              runtime("cudaStreamWaitEvent", 18, 1), *launch(2, 20, 26, 10, stream=20),
              *launch(3, 30, 71, 10, stream=7)]
    g = read_graph(write_trace(tmp_path / "t.json", events))
    (wait,) = g.waits
    assert wait.stream == 20 and wait.awaited.correlation == 1  # stream 20 waits for what 7 had before the record


def test_a_call_and_its_kernel_without_correlation_args_are_linked_by_their_ac2g_flow(tmp_path: Path):
    events = [runtime("cudaLaunchKernel", 10, 5), gpu("k", 30, 5, stream=7, corr=None),
              {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 9, "pid": 100, "tid": 1, "ts": 10},
              {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 9, "pid": 0, "tid": 7, "ts": 30, "bp": "e"}]
    g = read_graph(write_trace(tmp_path / "t.json", events))
    (op,) = g.gpu_ops()
    assert op.launch is not None and op.launch.start == 10 and g.unlinked == 0


def test_event_and_device_syncs_wait_for_what_was_enqueued_before_the_record_or_the_call(tmp_path: Path):
    events = [*launch(1, 0, 10, 100, stream=7), runtime("cudaEventRecord", 6, 1),
              *launch(2, 8, 110, 50, stream=7), *launch(3, 9, 12, 30, stream=20),
              runtime("cudaEventSynchronize", 20, 95), runtime("cudaDeviceSynchronize", 120, 45)]
    g = read_graph(write_trace(tmp_path / "t.json", events))
    event, device = g.syncs
    assert [a.correlation for a in event.awaited] == [1]  # recorded after launch 1, before launch 2
    assert sorted(a.correlation for a in device.awaited) == [2, 3]  # each stream's last op


def test_an_event_sync_waits_for_nothing_its_thread_launched_after_the_record_it_cannot_see(tmp_path: Path):
    # Synthetic plumbing. The main thread records an event after launch 1; the autograd thread (tid 2) launches a long
    # kernel, then synchronizes on that event and returns at once: the trace names no event, and the thread's own
    # last launch (2) is still running when the call returns, so it cannot be what the call waited for.
    events = [*launch(1, 0, 10, 20, stream=7), runtime("cudaEventRecord", 6, 1),
              *launch(2, 40, 45, 500, stream=7, tid=2), runtime("cudaEventSynchronize", 50, 8, tid=2),
              runtime("cudaStreamSynchronize", 60, 490, tid=2)]
    g = read_graph(write_trace(tmp_path / "t.json", events))
    event, stream = g.syncs
    assert event.awaited == []  # was [launch 2's kernel], which ended 487 µs after the call returned
    assert [a.correlation for a in stream.awaited] == [2]  # a sync that did block keeps what it waited for


def test_nested_host_ops_get_their_depth_and_an_overhanging_child_is_cut_to_its_parent(tmp_path: Path):
    events = [host("aten::linear", 0, 100), host("aten::mm", 10, 95), runtime("cudaLaunchKernel", 20, 5)]
    (t,) = read_graph(write_trace(tmp_path / "t.json", events)).threads
    assert [(op.name, op.depth, op.end) for op in t.ops] == [("aten::linear", 0, 100), ("aten::mm", 1, 100),
                                                              ("cudaLaunchKernel", 2, 25)]


def test_nccl_kernels_match_across_ranks_by_group_and_sequence_and_only_with_every_member(tmp_path: Path):
    def nccl(rank: int, seq: int, ts: float) -> Path:
        kernel = launch(1, ts - 10, ts, 100, stream=30, name="ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
                        **{"Collective name": "allreduce", "Process Group Ranks": "[0, 1]", "Seq": seq})
        return write_trace(tmp_path / f"r{rank}s{seq}.json", kernel, rank=rank, world_size=2)

    a, b, c = (read_graph(nccl(0, 5, 100)), read_graph(nccl(1, 5, 150)), read_graph(nccl(1, 6, 150)))
    (ka,), (kb,), (kc,) = (list(g.gpu_ops()) for g in (a, b, c))
    assert ka.collective == CollectiveId("all_reduce", (0, 1), 5)
    items = [(r, k.collective, k.start, k.end, k) for r, k in ((0, ka), (1, kb))]
    assert match_collectives(items) == [[ka, kb]]
    assert match_collectives([items[0], (1, kc.collective, kc.start, kc.end, kc)]) == []  # seq 6 is another one


def test_graphs_are_built_with_the_cycle_collector_paused_and_it_comes_back_after():
    import gc

    from ledger.evidence.exec_graph import cyclic_gc_paused

    assert gc.isenabled()
    with pytest.raises(ValueError), cyclic_gc_paused():
        assert not gc.isenabled()
        raise ValueError
    assert gc.isenabled()
    gc.disable()
    try:
        with cyclic_gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own pause is left as it was
    finally:
        gc.enable()
