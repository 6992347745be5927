"""The pipelined schedules on a toy model: a residual tanh-MLP stack split over gloo ranks.

Specification: pipelining reorders the work but not the arithmetic, so every rank's gradients (and the last stage's
micro-batch losses) equal those of the whole stack run in one process by forward_backward_no_pipelining, to fp32
rounding. Along the way: a sent activation keeps no storage (deallocate_output_tensor), each chunk's DP grad
reduction is launched once, where Megatron Core launches it (docs/engine.md, "Schedules"), and
finalize_model_grads_func sees every chunk once.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import pytest
import torch

from engine.parallel_state import ParallelState
from engine.pipeline_parallel.schedules import (
    ScheduleConfig,
    forward_backward_no_pipelining,
    get_forward_backward_func,
)
from tests.support.gloo import run_distributed
from tests.support.recording_probes import RangeLog

HIDDEN, SEQ, MBS, LAYERS = 8, 4, 2, 8


class ToyStage(torch.nn.Module):
    """Residual blocks h + W tanh(h) for some of the global layers; the last stage returns the MSE loss."""

    def __init__(self, layer_ids: list[int], pre_process: bool, post_process: bool):
        super().__init__()
        self.layer_ids = layer_ids
        self.layers = torch.nn.ModuleList(_layer(j) for j in layer_ids)
        self.pre_process, self.post_process = pre_process, post_process
        self.input_tensor: torch.Tensor | None = None
        self.sync_enabled = True
        self.backward_sync: list[tuple[int, bool]] = []  # (micro-batch, grad sync enabled) per backward

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def no_sync(self):
        @contextlib.contextmanager
        def ctx():
            self.sync_enabled = False
            try:
                yield
            finally:
                self.sync_enabled = True
        return ctx()

    def forward(self, microbatch: int, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self._check_sent_activations()
        h = x if self.pre_process else self.input_tensor
        for layer in self.layers:
            h = h + layer(torch.tanh(h))
        h.register_hook(lambda g: self.backward_sync.append((microbatch, self.sync_enabled)) or g)
        if self.post_process:
            return ((h - target) ** 2).mean()
        SENT.produced.append(weakref.ref(h))
        return h

    @staticmethod
    def _check_sent_activations() -> None:
        """Called before each forward: every earlier output of this rank's chunks has been sent by now."""
        alive = [t for t in (ref() for ref in SENT.produced) if t is not None]
        freed = [t for t in alive if t.untyped_storage().nbytes() == t.element_size()]
        SENT.held_deallocated = max(SENT.held_deallocated, len(freed))
        SENT.held_with_storage = max(SENT.held_with_storage, len(alive) - len(freed))


class SentActivations:
    """This process's (= rank's) record of the activations its stages returned for sending."""

    def __init__(self):
        self.produced: list[weakref.ref] = []
        self.held_deallocated = 0  # most sent activations held for backward at once, storage freed
        self.held_with_storage = 0  # sent activations seen alive with their storage: must stay 0


SENT = SentActivations()


def _layer(j: int) -> torch.nn.Linear:
    torch.manual_seed(1000 + j)
    return torch.nn.Linear(HIDDEN, HIDDEN)


def _microbatches(m: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(i, torch.randn(SEQ, MBS, HIDDEN, generator=g), torch.randn(SEQ, MBS, HIDDEN, generator=g))
            for i in range(m)]


def forward_step_func(data_iterator, model: ToyStage):
    microbatch, x, target = next(data_iterator)
    out = model(microbatch, x, target)
    return out, (lambda loss: (loss, {"loss": loss.detach()})) if model.post_process else None


def _grads(chunks: list[ToyStage]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {id_: (layer.weight.grad.clone(), layer.bias.grad.clone())
            for chunk in chunks for id_, layer in zip(chunk.layer_ids, chunk.layers)}


def _build_chunks(pp: int, vpp: int, rank: int) -> list[ToyStage]:
    per_virtual_stage = LAYERS // (pp * vpp)
    chunks = []
    for c in range(vpp):
        vs = c * pp + rank
        ids = list(range(vs * per_virtual_stage, (vs + 1) * per_virtual_stage))
        chunks.append(ToyStage(ids, pre_process=vs == 0, post_process=vs == pp * vpp - 1))
    return chunks


def reference(m: int) -> tuple[list[float], dict]:
    model = ToyStage(list(range(LAYERS)), pre_process=True, post_process=True)
    losses = forward_backward_no_pipelining(forward_step_func=forward_step_func,
                                            data_iterator=iter(_microbatches(m)), model=model, num_microbatches=m,
                                            config=ScheduleConfig())
    return [d["loss"].item() for d in losses], _grads([model])


class TimelineProbes:
    """Probes that log each backward ("backward", chunk, micro-batch) and each P2P exchange ("p2p",) into the rank's
    event list, where the DDP callbacks log their calls too: the rank's timeline, in order."""

    def __init__(self, events: list[tuple]):
        self.events = events

    def range(self, name: str, category: str, **attrs):
        if category == "backward":
            self.events.append(("backward", attrs["chunk"], attrs["microbatch"]))
        elif category == "pp-comm":
            self.events.append(("p2p",))
        return contextlib.nullcontext()


def _callbacks(events: list[tuple]) -> list[tuple]:
    return [e for e in events if e[0] in ("grad_sync", "finalize")]


def _pipeline_worker(rank: int, world_size: int, vpp: int, m: int, use_grad_sync_func: bool,
                     forward_only: bool = False) -> dict:
    torch.manual_seed(0)
    ps = ParallelState.initialize(tp=1, pp=world_size, virtual_pipeline_size=vpp if vpp > 1 else None)
    chunks = _build_chunks(world_size, vpp, rank)
    events: list[tuple] = []

    def grad_sync(c: int):
        return lambda params: events.append(("grad_sync", c))

    one_or_list = (lambda xs: xs[0]) if vpp == 1 else list
    config = ScheduleConfig(
        pipeline_model_parallel_size=world_size, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        no_sync_func=one_or_list([c.no_sync for c in chunks]),
        grad_sync_func=one_or_list([grad_sync(c) for c in range(vpp)]) if use_grad_sync_func else None,
        finalize_model_grads_func=lambda model: events.append(("finalize", len(model))),
        probes=TimelineProbes(events), parallel_state=ps, tensor_shape=(SEQ, MBS, HIDDEN))
    func = get_forward_backward_func(world_size, vpp if vpp > 1 else None)
    iterators = [iter(_microbatches(m)) for _ in chunks]
    losses = func(forward_step_func=forward_step_func, data_iterator=one_or_list(iterators),
                  model=one_or_list(chunks), num_microbatches=m, config=config, forward_only=forward_only)
    return {"losses": [d["loss"].item() for d in losses], "events": events,
            "grads": {} if forward_only else _grads(chunks),
            "backward_sync": [c.backward_sync for c in chunks],
            "held_deallocated": SENT.held_deallocated, "held_with_storage": SENT.held_with_storage}


@functools.lru_cache(maxsize=None)
def pipelined(pp: int, vpp: int, m: int, use_grad_sync_func: bool, forward_only: bool = False) -> list[dict]:
    """_pipeline_worker's results by rank, run once per arguments: several tests read the same run (read only)."""
    return run_distributed(_pipeline_worker, pp, vpp, m, use_grad_sync_func, forward_only)


@pytest.mark.slow
@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 8), (4, 1, 8), (2, 2, 4), (2, 2, 6)])
def test_pipelined_losses_and_grads_equal_single_process(pp, vpp, m):
    ref_losses, ref_grads = reference(m)
    results = pipelined(pp, vpp, m, False)
    assert all(not r["losses"] for r in results[:-1]), "only the last stage computes losses"
    assert results[-1]["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-7)
    grads = {k: v for r in results for k, v in r["grads"].items()}
    assert sorted(grads) == list(range(LAYERS))
    for j, (w, b) in grads.items():
        torch.testing.assert_close(w, ref_grads[j][0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(b, ref_grads[j][1], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("pp,vpp,m", [(4, 1, 8), (2, 2, 4)])
def test_forward_only_gives_the_losses_and_no_gradients(pp, vpp, m):
    results = pipelined(pp, vpp, m, False, True)
    assert results[-1]["losses"] == pytest.approx(reference(m)[0], rel=1e-5, abs=1e-7)
    assert all(_callbacks(r["events"]) == [] and r["held_with_storage"] == 0 for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("pp,vpp,m", [(4, 1, 8), (2, 2, 4)])
def test_sent_activations_keep_no_storage(pp, vpp, m):
    """1F1B stage 0 of 4 holds 3 warmup activations for backward; each must be a one-element shell."""
    results = pipelined(pp, vpp, m, False)
    assert all(r["held_with_storage"] == 0 for r in results)
    expected_held_on_stage0 = pp - 1 if vpp == 1 else 2 * (pp - 1) + (vpp - 1) * pp  # the warmup forwards
    assert results[0]["held_deallocated"] == expected_held_on_stage0


@pytest.mark.slow
@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 4), (2, 2, 4)])
def test_grad_sync_only_in_each_chunks_last_backward(pp, vpp, m):
    """Without grad_sync_func, on every stage each chunk's last backward (micro-batch m - 1) runs with DDP's bucket
    hooks enabled, so they launch its reduction during that backward; every other backward runs under no_sync."""
    results = pipelined(pp, vpp, m, False)
    for r in results:
        for chunk_log in r["backward_sync"]:
            assert chunk_log == [(i, i == m - 1) for i in range(m)]
        assert _callbacks(r["events"]) == [("finalize", vpp)]


@pytest.mark.slow
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_1f1b_grad_sync_func_overlaps_stage0_and_later_stages_launch_after_their_last_exchange(pp, m):
    """1F1B with grad_sync_func: stage 0 (the stage with several buckets) runs its last backward with the bucket
    hooks enabled and never calls grad_sync_func; every later stage runs all backwards under no_sync and calls
    grad_sync_func once, after the P2P send of its last backward (in the pipeline bubble), then finalizes."""
    stage0, *later = pipelined(pp, 1, m, True)
    assert stage0["backward_sync"] == [[(i, i == m - 1) for i in range(m)]]
    assert _callbacks(stage0["events"]) == [("finalize", 1)]
    for r in later:
        assert r["backward_sync"] == [[(i, False) for i in range(m)]]
        assert r["events"][-4:] == [("backward", 0, m - 1), ("p2p",), ("grad_sync", 0), ("finalize", 1)]
        assert _callbacks(r["events"]) == [("grad_sync", 0), ("finalize", 1)]


@pytest.mark.slow
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_grad_sync_func_launches_each_chunk_after_its_last_backward(pp, m):
    """Interleaved with grad_sync_func, every backward runs under no_sync. If chunk c's last backward (micro-batch
    m - 1) is stage s's k-th, the stage launches c right after its (k + s)-th backward (before that step's P2P
    exchange), so all stages launch c at about the same time; a stage with fewer backwards launches c after its
    last exchange. Each chunk is launched once, then finalize_model_grads runs."""
    vpp = 2
    for stage, r in enumerate(pipelined(pp, vpp, m, True)):
        assert r["backward_sync"] == [[(i, False) for i in range(m)]] * vpp
        events = r["events"]
        backwards = [e for e in events if e[0] == "backward"]
        assert sorted(_callbacks(events)) == [("finalize", vpp)] + [("grad_sync", c) for c in range(vpp)]
        assert events[-1] == ("finalize", vpp)
        for chunk in range(vpp):
            launch = events.index(("grad_sync", chunk))
            k = backwards.index(("backward", chunk, m - 1)) + stage
            if k < len(backwards):
                assert events[launch - 1] == backwards[k], f"stage {stage} chunk {chunk}"
            else:
                assert {e[0] for e in events[launch:]} == {"grad_sync", "finalize"}, f"stage {stage} chunk {chunk}"


def test_get_forward_backward_func_chooses_by_pipeline_and_virtual_size():
    from engine.pipeline_parallel import schedules
    assert get_forward_backward_func(1) is schedules.forward_backward_no_pipelining
    assert get_forward_backward_func(2) is schedules.forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(2, 1) is schedules.forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(2, 2) is schedules.forward_backward_pipelining_with_interleaving



def _p2p_worker(rank: int, world_size: int) -> dict:
    from engine.pipeline_parallel.p2p_communication import P2PCommunicator
    ps = ParallelState.initialize(tp=1, pp=2)
    probes = RangeLog()
    p2p = P2PCommunicator(ps, (SEQ, MBS, HIDDEN), torch.float32, "cpu", probes)
    value = lambda k: torch.full((SEQ, MBS, HIDDEN), float(10 * k + rank))  # noqa: E731
    exchange = p2p.send_forward_backward_recv_forward_backward
    got = []
    if rank == 0:
        exchange(value(1), None, recv_prev=False, recv_next=False)
        got.append(exchange(None, None, recv_prev=False, recv_next=True)[1])
        got.append(exchange(value(3), None, recv_prev=False, recv_next=True)[1])
    else:
        got.append(exchange(None, None, recv_prev=True, recv_next=False)[0])
        exchange(None, value(2), recv_prev=False, recv_next=False)
        got.append(exchange(None, value(4), recv_prev=True, recv_next=False)[0])
    return {"got": [(t[0, 0, 0].item(), t.requires_grad) for t in got], "ranges": probes.ranges}


@pytest.mark.slow
def test_p2p_exchanges_pair_up_and_each_is_one_pp_comm_range_named_for_what_moves():
    rank0, rank1 = run_distributed(_p2p_worker, 2)
    assert rank1["got"] == [(10.0, True), (30.0, True)]  # activations arrive ready to collect their gradient
    assert rank0["got"] == [(21.0, False), (41.0, False)]
    assert rank0["ranges"] == [("send_forward", "pp-comm"), ("recv_backward", "pp-comm"),
                               ("send_forward_recv_backward", "pp-comm")]
    assert rank1["ranges"] == [("recv_forward", "pp-comm"), ("send_backward", "pp-comm"),
                               ("send_backward_recv_forward", "pp-comm")]


def test_p2p_shape_is_sequence_first_and_split_by_tp_under_sequence_parallelism():
    from engine.pipeline_parallel.p2p_communication import p2p_tensor_shape
    assert p2p_tensor_shape(32, 2, 64) == (32, 2, 64)
    assert p2p_tensor_shape(32, 2, 64, tensor_model_parallel_size=2) == (32, 2, 64)
    assert p2p_tensor_shape(32, 2, 64, tensor_model_parallel_size=2, sequence_parallel=True) == (16, 2, 64)
