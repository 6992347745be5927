"""--moe-grouped-gemm: the experts' linears as grouped GEMMs over rows grouped by expert, the counts kept on the device
(engine/transformer/moe/grouped_gemm_util.py, experts.py GroupedMLP), give SequentialMLP's numbers, fp32 to 1e-5:
the GEMM alone (rows past the groups), the MoE layer with torch._grouped_mm (which torch 2.13 also runs on CPU) and
with the padded-bmm fallback, and a training run. At EP 1 the layer reads nothing from the device: it runs on fake
tensors, which have no values. Multi-process EP parity with grouped GEMMs: tests/test_moe_parity.py.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from common.arguments import parse_args
from common.config import ModelConfig
from engine.tensor_parallel.mappings import TPGroup
from engine.transformer.moe import grouped_gemm_util
from engine.transformer.moe.expert_parallel import EPGroup
from engine.transformer.moe.experts import GroupedMLP
from engine.transformer.moe.grouped_gemm_util import ExpertGroups, grouped_gemm, stacked_weights
from engine.transformer.moe.moe_layer import MoEContext, MoELayer
from tests.support.compiled import compiled_as_on_gpu
from tests.support.gloo import world_of_one
from tests.support.parity import assert_flags_change_no_training

EP1 = MoEContext(ep=EPGroup(None, 1, 0))
IMPLS = {"grouped_mm": {"cpu"}, "padded_bmm": set()}  # GROUPED_MM_DEVICE_TYPES: on CPU, _grouped_mm or the fallback


def moe_config(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=16, ffn_hidden_size=24, num_attention_heads=1, num_query_groups=1,
                  vocab_size=16, seq_length=8, max_position_embeddings=8, num_experts=4, moe_router_topk=2,
                  moe_aux_loss_coeff=0.01)
    return ModelConfig(**{**fields, **overrides})


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_past_the_groups_come_out_zero_and_take_no_gradient(monkeypatch, impl):
    """Counts (2, 0, 3) over 7 rows: rows 0-1 use expert 0, rows 2-4 expert 2, rows 5-6 belong to no expert (dropped
    assignments), even when they hold NaN."""
    monkeypatch.setattr(grouped_gemm_util, "GROUPED_MM_DEVICE_TYPES", IMPLS[impl])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 8, generator=gen)
    x[5:] = float("nan")
    x.requires_grad_()
    weight = torch.randn(3, 4, 8, generator=gen, requires_grad=True)
    groups = ExpertGroups.of(torch.tensor([2, 0, 3]), 7, max_rows=3, may_drop=True)
    y = grouped_gemm(x, weight, groups)
    expected = torch.cat([x[:2] @ weight[0].t(), x[2:5] @ weight[2].t(), torch.zeros(2, 4)])
    torch.testing.assert_close(y, expected.detach(), rtol=1e-6, atol=1e-6)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad[5:], torch.zeros(2, 8)) and not weight.grad.isnan().any()
    torch.testing.assert_close(weight.grad[1], torch.zeros(4, 8))  # the empty expert


def _layer_outputs(config: ModelConfig, dtype: torch.dtype = torch.float32):
    layer = MoELayer(config, 0, moe=EP1, tp=TPGroup(None, 1, 0), params_dtype=dtype, device="cpu", seed=3)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, config.hidden_size, generator=gen).to(dtype).requires_grad_()
    y = layer(x)
    y.backward(torch.randn(y.shape, generator=gen).to(dtype))
    return layer, y.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["no-capacity", "dropping"])
def test_grouped_experts_give_sequential_mlps_outputs_and_gradients(monkeypatch, impl, capacity_factor):
    monkeypatch.setattr(grouped_gemm_util, "GROUPED_MM_DEVICE_TYPES", IMPLS[impl])
    sequential = _layer_outputs(moe_config(moe_expert_capacity_factor=capacity_factor))
    grouped = _layer_outputs(moe_config(moe_expert_capacity_factor=capacity_factor, moe_grouped_gemm=True))
    assert isinstance(grouped[0].experts, GroupedMLP)
    if capacity_factor is not None:
        assert grouped[0].record.dropped.sum() > 0, "the capacity must drop some assignments"
    assert grouped[0].record.tokens.tolist() == sequential[0].record.tokens.tolist()
    for got, expected in zip(grouped[1:3], sequential[1:3]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert grouped[3].keys() == sequential[3].keys()  # the same parameters, by the same names
    for name, grad in grouped[3].items():
        torch.testing.assert_close(grad, sequential[3][name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["no-capacity", "dropping"])
def test_at_ep1_the_grouped_layers_forward_reads_nothing_from_the_device(monkeypatch, impl, capacity_factor):
    """The forward on fake tensors (no values: an op that needs one on the host raises). SequentialMLP's layer
    cannot: it reads the counts to split the rows. (The grouped backward reads them, from the copy its forward
    started without waiting: grouped_gemm_util.HostCounts.)"""
    monkeypatch.setattr(grouped_gemm_util, "GROUPED_MM_DEVICE_TYPES", IMPLS[impl])
    for grouped in (True, False):
        config = moe_config(moe_expert_capacity_factor=capacity_factor, moe_grouped_gemm=grouped)
        layer = MoELayer(config, 0, moe=EP1, tp=TPGroup(None, 1, 0), params_dtype=torch.bfloat16, device="cpu",
                         seed=3)
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.randn(8, 2, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
            if grouped:
                assert layer(x).shape == x.shape
            else:
                with pytest.raises(DataDependentOutputException):
                    layer(x)


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
@pytest.mark.parametrize("capacity", ["", "--moe-expert-capacity-factor 0.5"], ids=["no-capacity", "dropping"])
def test_what_the_layer_saves_is_the_ledgers_moe_formula(monkeypatch, grouped, capacity):
    """Every distinct storage autograd saves in one MoE layer's forward (fp32, CPU, torch._grouped_mm and the
    compiled SwiGLU and combine as on a GPU), parameters aside, against
    ledger/models/formulas/activations.moe_saved_tensors: grouped, the offsets (not the weights), and at EP 1 all
    T k = 128 rows carried (the kept 64 under the capacity); beyond it only the load-balancing loss's scalar and
    its [E] assignment fractions."""
    monkeypatch.setattr(grouped_gemm_util, "GROUPED_MM_DEVICE_TYPES", {"cpu"})
    from ledger.models.formulas import activations

    flags = (f"--model tiny --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --seq-length 32 "
             f"--micro-batch-size 2 {capacity}" + (" --moe-grouped-gemm" if grouped else ""))
    cfg = parse_args(flags.split())
    layer = MoELayer(cfg.model, 0, moe=EP1, tp=TPGroup(None, 1, 0), params_dtype=torch.float32, device="cpu", seed=3)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with compiled_as_on_gpu("aot_eager_decomp_partition"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(torch.randn(32, 2, 64, requires_grad=True))
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    measured = sum(n for ptr, n in saved.items() if ptr not in params)
    formula = activations.moe_saved_tensors(cfg)
    rows = formula["dispatch.row_index[int64]"] // 8
    assert rows == (128 if grouped or not capacity else 64)
    assert ("experts.group_offsets[int32]" in formula) == grouped
    assert measured == sum(formula.values()) + 4 + 4 * 4


@pytest.mark.parametrize("flags", [["--moe-grouped-gemm"], []], ids=["grouped", "sequential"])
def test_every_parameter_the_forward_reads_is_waited_for_by_a_module_that_runs(flags):
    """Under --overlap-param-gather DDP waits for a parameter's all-gather in the forward pre-hook of the module
    that reads it (params_used_by_forward). GroupedMLP reads its experts' weights without calling their linears:
    its own hook must cover them, or a forward could use a weight still being gathered. Also the fused loss (the
    output layer module runs it)."""
    from engine.distributed.distributed_data_parallel import params_used_by_forward
    from engine.models.gpt_model import GPTModel
    from engine.parallel_state import ParallelState

    cfg = parse_args(["--model", "tiny", "--num-layers", "2", "--num-experts", "4", "--moe-router-topk", "2",
                      "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "linear", *flags])
    state = ParallelState(rank=0, world_size=1, tp_size=1, pp_size=1, dp_size=1, cp_size=1, tp_rank=0, pp_rank=0,
                          dp_rank=0, cp_rank=0)
    model = GPTModel(cfg.model, state, pre_process=True, post_process=True, layer_numbers=[0, 1],
                     sequence_parallel=False, params_dtype=torch.float32, device="cpu")
    ran: list[torch.nn.Module] = []
    for module in model.modules():
        module.register_forward_pre_hook(lambda m, args: ran.append(m))
    ids = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    model(ids[:, :-1], ids[:, 1:])
    waited = {id(p) for m in ran for p in params_used_by_forward(m)}
    assert {name for name, p in model.named_parameters() if id(p) not in waited} == set()


def test_a_training_run_with_grouped_gemms_is_the_sequential_run():
    """Four steps of the tiny MoE model on a world of one (capacity drops, a load-balancing loss, clipping): the same
    losses, grad norms and weights (the padded-bmm fallback: CPU)."""
    base = ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "4", "--lr", "3e-3", "--clip-grad", "0.05", "--mock-data", "--num-experts", "4",
            "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-expert-capacity-factor", "1.0"]
    assert_flags_change_no_training(base, ["--moe-grouped-gemm"])


def test_weights_one_stride_apart_are_read_in_place_and_others_are_copied():
    """Three [4, 8] weights at elements 0, 40 and 80 of one buffer (a stride of 40, 8 elements of padding between
    them) are one [3, 4, 8] view of it; out of order, unevenly spaced or in separate tensors, a stacked copy."""
    buffer = torch.arange(120.0)
    views = [buffer[o:o + 32].view(4, 8) for o in (0, 40, 80)]
    stacked = stacked_weights(views)
    assert stacked.data_ptr() == buffer.data_ptr() and stacked.stride() == (40, 8, 1)
    assert torch.equal(stacked, torch.stack(views))
    for weights in (views[::-1], [buffer[o:o + 32].view(4, 8) for o in (0, 40, 88)], [v.clone() for v in views]):
        copy = stacked_weights(weights)
        assert copy.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
        assert torch.equal(copy, torch.stack(weights))


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp", "distopt"])
def test_in_ddps_buffer_the_grouped_experts_weights_are_one_view_and_sequentials_are_not(distributed_optimizer):
    """DDP lays parameters out last-first: GroupedMLP registers its experts last-first, so each linear's weights
    lie one stride apart, first expert first, and the grouped GEMMs read them where they are (under the distributed
    optimizer's 64-element alignment too). SequentialMLP's order puts them last expert first: a copy."""
    from engine.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from engine.models.gpt_model import GPTModel
    from engine.parallel_state import ParallelState

    for grouped in (True, False):
        cfg = parse_args(["--model", "tiny", "--num-layers", "2", "--num-experts", "4", "--moe-router-topk", "2",
                          *(["--moe-grouped-gemm"] if grouped else [])])
        with world_of_one():
            state = ParallelState.initialize(moe=True)
            model = GPTModel(cfg.model, state, pre_process=True, post_process=True, layer_numbers=[0, 1],
                             sequence_parallel=False, params_dtype=torch.float32, device="cpu")
            DistributedDataParallel(DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer),
                                    model, state)
            for layer in model.decoder.layers:
                experts = layer.mlp.experts.local_experts()
                for linear in ("linear_fc1", "linear_fc2"):
                    weights = [getattr(e, linear).weight for e in experts]
                    in_place = stacked_weights(weights).data_ptr() == weights[0].data_ptr()
                    assert in_place == grouped, (grouped, linear)


# moe-ffn 99: fc2's [64, 99] weights are no multiple of the 128-element bucket end, so a bucket closing between two
# experts would pad there; each bucket size below reaches its size inside some layer's experts.
@pytest.mark.parametrize("ffn, bucket_size", [(99, 20000), (99, 40000), (99, 60000), (128, 20000)])
def test_no_bucket_splits_a_grouped_layers_experts_in_the_engine_or_the_ledger(ffn, bucket_size):
    """A bucket of DDP's buffer never closes inside a grouped MoE layer's experts (their bucket group), so each
    linear's weights stay one stride apart and its grouped GEMMs read them in place whatever --ddp-bucket-size;
    the ledger's layout (ledger/models/formulas/buffer_layout.py) keeps the same rule, bucket for bucket."""
    from engine.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from engine.models.gpt_model import GPTModel
    from engine.parallel_state import ParallelState
    from ledger.models.formulas.buffer_layout import expert_rank_buffers

    cfg = parse_args(["--model", "tiny", "--num-layers", "2", "--num-experts", "4", "--moe-router-topk", "2",
                      "--moe-grouped-gemm", "--use-distributed-optimizer", "--overlap-grad-reduce",
                      "--moe-ffn-hidden-size", str(ffn), "--ddp-bucket-size", str(bucket_size)])
    with world_of_one():
        state = ParallelState.initialize(moe=True)
        model = GPTModel(cfg.model, state, pre_process=True, post_process=True, layer_numbers=[0, 1],
                         sequence_parallel=False, params_dtype=torch.float32, device="cpu")
        ddp = DistributedDataParallel(DistributedDataParallelConfig.from_train_config(cfg.train, 1), model, state)
    (buffer,) = [b for b in ddp.buffers if b.expert]
    predicted = expert_rank_buffers(cfg, 0)[0]
    assert len(buffer.layout.bucket_ranges) > 1  # the bucket size bites
    assert list(buffer.layout.bucket_ranges) == predicted.buckets
    assert {ddp.param_to_name[p]: r for p, r in buffer.param_index_map.items()} == {
        name: (start, end) for name, (start, end, _) in predicted.param_ranges.items()}
    for layer in model.decoder.layers:
        experts = layer.mlp.experts.local_experts()
        for linear in ("linear_fc1", "linear_fc2"):
            weights = [getattr(e, linear).weight for e in experts]
            assert stacked_weights(weights).data_ptr() == weights[0].data_ptr(), linear
