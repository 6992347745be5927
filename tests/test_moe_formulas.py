"""Mixture of experts in the ledger's formulas (issue 19, section 2): parameters split into dense and expert parts,
static bytes with the expert buffers sharded over the expert-data-parallel group, an MoE layer's saved activations,
FLOPs, and the expert-parallel all-to-all volume, from the config (uniform routing) and from a routing table.
Every expectation is derived by hand in its comment (docs/formulas.md, "Mixture of experts"), never by calling the
formula twice. plan / simulate are exercised through the CLI on the shapes the issue names.
"""
from __future__ import annotations

import json

import pytest

from cli.main import main as cli_main
from common.arguments import parse_args
from common.config import RunConfig
from common.errors import ConfigError
from common.ops.sizes import expert_capacity, uniform_kept_assignments
from ledger.models.formulas import activations, comm, flops, params
from ledger.models.formulas.buffer_layout import expert_rank_buffers, rank_buffers
from ledger.models.formulas.device_memory import communicators
from ledger.models.formulas.moe import RankExchange, exchanges, layer_volume
from ledger.models.formulas.static_memory import static_bytes, static_bytes_split
from ledger.models.simulate.hardware import load_hardware
from ledger.models.simulate.simulation import simulate
from ledger.models.simulate.topology import group_spans, link_for


def cfg(*flags: str) -> RunConfig:
    return parse_args(list(flags))


def tiny_moe(*flags: str, experts: int = 4, topk: int = 2, ep: int = 1, world: int = 1) -> RunConfig:
    return cfg("--model", "tiny", "--bf16", "--num-experts", str(experts), "--moe-router-topk", str(topk),
               "--expert-model-parallel-size", str(ep), "--world-size", str(world), *flags)


# tiny: h 64, f 176, 8 heads of 8, 4 query groups, vocab 1000 (padded to 1000 at divisible_by 8), 4 layers
ATTENTION = 64 * (64 + 2 * 32) + 64 * 64  # fused QKV [(8 + 2 x 4) x 8, 64] + proj [64, 64] = 12,288
NORMS = 2 * 64
EXPERT = 3 * 64 * 176  # gate, up [176, 64] each (fused fc1 [352, 64]) + down [64, 176] = 33,792
EMBEDDING = 1000 * 64


def test_an_moe_layer_holds_the_router_and_every_expert():
    # router [4, 64] = 256; four experts of 33,792
    per_layer = ATTENTION + NORMS + 4 * 64 + 4 * EXPERT
    assert per_layer == 147_840
    c = tiny_moe()
    assert params.params_per_layer(c.model) == per_layer
    assert params.params_total(c) == 4 * per_layer + EMBEDDING + 64  # tied, final norm


def test_mixtral_8x7b_has_its_public_46_7_billion_parameters_and_12_9_billion_active():
    c = cfg("--model", "mixtral-8x7b")
    assert c.model.untie_embeddings_and_output_weights and c.model.num_experts == 8
    # per layer: attention 4096 x (4096 + 2 x 1024) + 4096 x 4096 = 41,943,040; norms 8,192; router 8 x 4096;
    # experts 8 x 3 x 4096 x 14336 = 1,409,286,144: 1,451,270,144; x 32 + embedding and output 2 x 32000 x 4096
    # + final norm 4096
    per_layer = 41_943_040 + 8_192 + 32_768 + 1_409_286_144
    assert params.params_per_layer(c.model) == per_layer
    assert params.params_total(c) == 32 * per_layer + 2 * 32_000 * 4096 + 4096 == 46_702_792_704
    experts = 32 * 1_409_286_144
    assert params.active_params(c) == 46_702_792_704 - experts + experts * 2 // 8 == 12_879_925_248
    assert params.params_total(cfg("--model", "mixtral-8x7b-2l")) == 2 * per_layer + 2 * 32_000 * 4096 + 4096


def test_preset_moe_keys_yield_to_the_flags():
    c = cfg("--model", "mixtral-8x7b-2l", "--num-experts", "4", "--moe-router-topk", "1")
    assert (c.model.num_experts, c.model.moe_router_topk, c.model.hidden_size) == (4, 1, 4096)


def test_an_ep_rank_holds_a_contiguous_block_of_the_experts_and_all_dense_parameters():
    c = tiny_moe(experts=8, ep=2, world=4)
    split = params.params_per_rank_split(c, 0)
    assert split == {"dense": 4 * (ATTENTION + NORMS + 8 * 64) + EMBEDDING + 64, "expert": 4 * 4 * EXPERT}
    names = [t.name for t in params.chunk_tensors(c, 0, 0, ep_rank=1) if t.expert]
    assert names[:2] == ["decoder.layers.0.mlp.experts.4.linear_fc1.weight",
                         "decoder.layers.0.mlp.experts.4.linear_fc2.weight"]
    assert {n.split(".")[5] for n in names} == {"4", "5", "6", "7"}
    # the stage's count sums the EP group's experts once: every expert of the model
    assert params.params_per_stage(c) == [params.params_total(c)]


def test_expert_buffers_are_sharded_over_the_expert_data_parallel_group():
    # world 4, ep 2: dense dp 4, expert dp 2. Experts: 4 layers x 4 local experts x 33,792 = 540,672 elements
    # (each tensor a multiple of 64, one bucket of a multiple of 128: no padding); bf16 params, fp32 grads
    c = tiny_moe("--use-distributed-optimizer", experts=8, ep=2, world=4)
    (expert,) = expert_rank_buffers(c, 0)
    assert expert.numel == expert.numel_unpadded == 540_672
    assert all(n.split(".")[3] == "mlp" and ".experts." in n for n in expert.param_ranges)
    assert not any(".experts." in n for b in rank_buffers(c, 0) for n in b.param_ranges)
    part = static_bytes_split(c, 0, 0, 3)["expert"]
    owned = 540_672 // 2  # over the expert dp of 2, not the dp of 4
    assert (part.param_buffer, part.grad_buffer, part.master_params, part.adam_m) == (
        540_672 * 2, 540_672 * 4, owned * 4, owned * 4)
    assert static_bytes(c, 0, 0, 3).total == static_bytes_split(c, 0, 0, 3)["dense"].total + part.total


def test_an_expert_buffer_is_padded_to_its_own_data_parallel_size():
    # 1 layer, 2 experts of f 179, ep 2 on 256 ranks: dense dp 256, expert dp 128. The rank's one expert:
    # fc2 [64, 179] = 11,456 at 0, fc1 [358, 64] = 22,912 at 11,456 (both multiples of 64): ends at 34,368,
    # rounded up to lcm(128, 128) = 128 -> 34,432 (64 padding); at the dense dp's lcm(256, 128) it would be 34,560
    c = cfg("--model", "tiny", "--num-layers", "1", "--num-experts", "2", "--moe-router-topk", "1",
            "--moe-ffn-hidden-size", "179", "--expert-model-parallel-size", "2", "--world-size", "256",
            "--use-distributed-optimizer")
    (expert,) = expert_rank_buffers(c, 0)
    assert (expert.numel, expert.padding) == (34_432, 64)


def test_an_moe_layer_saves_the_router_the_routed_rows_and_the_combine():
    # tiny, bf16, b 1: T = 32 tokens, k 2 -> 64 rows, all kept without a capacity factor
    saved = activations.moe_saved_tensors(tiny_moe())
    assert saved == {
        "router.input=pre_mlp_layernorm.output": 2 * 32 * 64,
        "router.topk_indices[int64]": 8 * 64, "router.probs[fp32]": 4 * 64,
        "dispatch.row_index[int64]": 8 * 64,
        "experts.linear_fc1.input": 2 * 64 * 64, "experts.swiglu.input=linear_fc1.output": 2 * 64 * 352,
        "experts.linear_fc2.input": 2 * 64 * 176,
        "combine.slot_index[int64]": 8 * 64, "combine.expert_rows=experts.output": 2 * (64 + 1) * 64}
    layer = activations.layer_saved_tensors(tiny_moe())
    assert "linear_fc1.input" not in layer and layer["experts.linear_fc1.input"] == 2 * 64 * 64


def test_the_capacity_factor_bounds_the_routed_rows():
    # capacity ceil(32 x 2 / 4 x 0.5) = 8 per expert: at most 4 x 8 = 32 of the 64 assignments kept
    c = tiny_moe("--moe-expert-capacity-factor", "0.5")
    assert expert_capacity(32, c.model) == 8
    assert uniform_kept_assignments(32, c.model) == 32
    assert activations.moe_saved_tensors(c)["experts.linear_fc1.input"] == 2 * 32 * 64
    assert uniform_kept_assignments(32, tiny_moe("--moe-expert-capacity-factor", "2").model) == 64


def test_expert_flops_count_k_experts_per_token_not_the_router():
    moe, dense = tiny_moe(), cfg("--model", "tiny", "--bf16")
    tokens = moe.train.global_batch_size * 32
    # per token per layer: 3 GEMMs x 2 FLOPs x 3 passes x h f k for the experts (the router uncounted, as Megatron),
    # where the dense MLP has 3 x 2 x 3 x h f
    per_token_layer = 18 * 64 * 176 * 2 - 18 * 64 * 176
    assert flops.megatron_flops_per_step(moe) - flops.megatron_flops_per_step(dense) == 4 * tokens * per_token_layer


def test_a_routing_table_gives_each_ranks_sent_and_received_rows():
    # EP 2, 4 experts (rank 0 holds 0, 1; rank 1 holds 2, 3); kept assignments per source rank and expert
    kept = [[10, 2, 3, 5], [4, 7, 6, 1]]
    r0, r1 = exchanges(kept, 2)
    # rank 0 sends 20 (12 to itself, 8 to rank 1) and its experts get 10 + 2 + 4 + 7 = 23 (11 from rank 1)
    assert r0 == RankExchange(sent=20, sent_remote=8, received=23, received_remote=11)
    assert r1 == RankExchange(sent=18, sent_remote=11, received=15, received_remote=8)
    # a layer: dispatch and combine, forward and backward: 2 (sent + received) rows, over 2 micro-batches 8 calls
    v = layer_volume(r0, 128, 2, recomputed=False)
    assert (v.size_bytes, v.remote_bytes, v.calls) == (2 * 43 * 128, 2 * 19 * 128, 8)
    assert layer_volume(r0, 128, 2, recomputed=True).size_bytes == 3 * 43 * 128
    with pytest.raises(ValueError):
        exchanges(kept, 4)


def test_the_config_only_all_to_all_assumes_uniform_routing():
    # tiny fp32 (row 256 B), E 8, k 2, EP 2 on 4 ranks, 1 micro-batch: 64 rows sent and received a layer, half
    # remote; 4 layers x 2 x (64 + 64) rows; counts: 8 int64 a layer forward
    c = cfg("--model", "tiny", "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
            "--world-size", "4")
    a2a = comm.ep_collectives(c, 0)
    tokens, counts = a2a["ep.all_to_all.tokens[fp32]"], a2a["ep.all_to_all.counts[int64]"]
    assert (tokens.size_bytes, tokens.calls, tokens.bytes_per_rank) == (4 * 2 * 128 * 256, 16, 4 * 2 * 64 * 256)
    assert (counts.size_bytes, counts.calls) == (4 * 8 * 8, 4)
    assert "ep.all_to_all.tokens[fp32]" not in comm.step_collectives(c, 0)  # the reconciliation's exact volumes
    assert comm.ep_collectives(tiny_moe(), 0) == {}  # EP 1: nothing leaves the rank


def test_expert_gradients_are_reduced_over_the_expert_dp_group():
    c = tiny_moe("--use-distributed-optimizer", experts=8, ep=2, world=4)
    rs = comm.step_collectives(c, 0)["dp.reduce_scatter.expert_grads[fp32]"]
    assert (rs.group, rs.group_size, rs.size_bytes) == ("dp", 2, 540_672 * 4)


def test_an_ep_group_inside_a_node_uses_nvlink_and_across_nodes_the_nics():
    hw = load_hardware("H200")
    inside = group_spans(tiny_moe(experts=8, ep=8, world=16), 8)["ep"]
    across = group_spans(cfg("--model", "tiny", "--num-experts", "16", "--expert-model-parallel-size", "16",
                             "--world-size", "16", "--global-batch-size", "16"), 8)["ep"]
    assert (inside.nodes, inside.link, across.nodes, across.per_node) == (1, "NVLink", 2, 8)
    # across: of a rank's buffer 7/16 goes over NVLink, 8/16 through its NIC, which sets the time
    nic = hw.nic_bandwidth * hw.nic_efficiency
    expected = (15 / 16) / max(7 / (16 * hw.nvlink_bus_bandwidth), 8 / (16 * nic))
    assert link_for(across, hw).all_to_all_bandwidth == pytest.approx(expected)
    assert link_for(inside, hw).all_to_all_bandwidth == hw.nvlink_bus_bandwidth


def test_plan_shows_dense_and_expert_parts_and_the_all_to_all(capsys):
    flags = ["--model", "tiny", "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size",
             "2", "--world-size", "4"]
    assert cli_main(["plan", *flags, "--json"]) == 0
    moe = json.loads(capsys.readouterr().out)["moe"]
    stage = moe["per_stage"][0]
    assert stage["params"]["expert"] == 4 * 4 * EXPERT and moe["expert_dp"] == 2
    assert stage["all_to_all"]["ep.all_to_all.tokens[fp32]"]["remote_bytes"] == 4 * 2 * 64 * 256
    assert cli_main(["plan", *flags]) == 0
    text = capsys.readouterr().out
    assert "mixture of experts: 8 experts" in text and "ep.all_to_all.tokens[fp32]" in text


def test_simulate_prices_the_exposed_all_to_all_on_the_ep_link(capsys):
    flags = ["--model", "tiny", "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size",
             "2", "--world-size", "4", "--hardware", "H200"]
    assert cli_main(["simulate", *flags, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["groups"]["ep"] == {"size": 2, "nodes": 1, "link": "NVLink"}
    # the all-to-alls are ops of the replayed passes (ledger/models/time_model/ops.py): the stage's exposed "ep"
    exposed = d["step"]["per_stage"][0]["exposed_comm_s"]["ep"]
    assert exposed > 0 and d["moe"]["all_to_all_step_s"] == exposed == d["moe"]["per_stage"][0]["all_to_all_s"]
    assert d["moe"]["per_stage"][0]["static_bytes"]["expert"] > 0
    assert cli_main(["simulate", *flags]) == 0
    assert "mixture of experts" in capsys.readouterr().out


def test_the_experts_must_split_evenly_over_the_ep_group():
    with pytest.raises(ConfigError, match="not divisible by --expert-model-parallel-size"):
        cfg("--model", "tiny", "--num-experts", "6", "--expert-model-parallel-size", "4", "--world-size", "4")


def test_the_cut_mixtral_preset_fits_one_h200_with_adam():
    sim = simulate(parse_args(["--model", "mixtral-8x7b-2l", "--bf16", "--use-distributed-optimizer"],
                              megatron_model=True), load_hardware("H200"))
    assert sim.fits and sim.memory[0].peak.static.total > 50 * 2**30  # 3.16 B parameters x 18 B: the bulk


def test_an_moe_rank_holds_a_communicator_for_each_expert_group_of_more_than_one_rank():
    # the engine builds ep, expt_dp and expt_mp for MoE models only, every rank in one of each; world 4 at EP2:
    # ep [0, 1], expt_dp [0, 2], expt_mp (tp-ep-pp) [0, 1], all of two ranks
    dense, moe = cfg("--model", "tiny", "--world-size", "4"), tiny_moe(experts=8, ep=2, world=4)
    assert communicators(moe, 0) == communicators(dense, 0) + 3
    # world 2 at EP2: expt_dp is rank 0 alone, so no communicator
    dense, moe = cfg("--model", "tiny", "--world-size", "2"), tiny_moe(experts=8, ep=2, world=2)
    assert communicators(moe, 0) == communicators(dense, 0) + 2
