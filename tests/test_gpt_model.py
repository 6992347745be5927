"""GPTModel: TP and PP splits reproduce the single-process model; layer assignment; tied and untied output layers; the
reference run's parameter count (docs/formulas.md)."""
from __future__ import annotations

import pytest
import torch

from common.arguments import parse_args
from common.config import PRESETS, ModelConfig
from engine.distributed import DistributedDataParallel, DistributedDataParallelConfig
from engine.models.gpt_model import GPTModel, build_model_chunks, set_embedding_gradient_fusion
from engine.parallel_state import ParallelState
from tests.support.gloo import run_distributed, world_of_one

# tiny: vocab 1000 padded to a multiple of 8 x TP -> 1000 at TP=1 and 1008 at TP=2, so padding is exercised. Tied,
# Megatron's default.
TINY = ModelConfig(**PRESETS["tiny"])
UNTIED = ModelConfig(**PRESETS["tiny"], untie_embeddings_and_output_weights=True)
B, S = 2, 16


def _single_process_state(pp_size: int = 1, pp_rank: int = 0) -> ParallelState:
    """A ParallelState with TP=1 needs no process group: the model never communicates."""
    return ParallelState(rank=pp_rank, world_size=pp_size, tp_size=1, pp_size=pp_size, dp_size=1, cp_size=1,
                         tp_rank=0, pp_rank=pp_rank, dp_rank=0, cp_rank=0)


def _tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, TINY.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _whole_model(state: ParallelState, sequence_parallel: bool = False, config: ModelConfig = TINY) -> GPTModel:
    return GPTModel(config, state, pre_process=True, post_process=True, layer_numbers=list(range(config.num_layers)),
                    sequence_parallel=sequence_parallel, params_dtype=torch.float32, device="cpu")


def _assemble(param: torch.nn.Parameter, grad: torch.Tensor, group) -> torch.Tensor:
    """The full tensor from every TP rank's slice, undoing the strided split described in random.partition."""
    import torch.distributed as dist
    slices = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(slices, grad.contiguous(), group=group)
    if not param.tensor_model_parallel:
        return slices[0]
    dim, stride = param.partition_dim, param.partition_stride
    pieces = [s.chunk(stride, dim=dim) for s in slices]
    return torch.cat([pieces[rank][k] for k in range(stride) for rank in range(len(slices))], dim=dim)


def _tp_matches_tp1(rank: int, world_size: int, sequence_parallel: bool) -> dict[str, float]:
    import torch.distributed as dist
    torch.manual_seed(0)
    state = ParallelState.initialize(tp=world_size)
    input_ids, labels = _tokens()

    reference = _whole_model(_single_process_state())
    ref_loss = reference(input_ids, labels)
    ref_loss.mean().backward()

    model = _whole_model(state, sequence_parallel)
    assert model.padded_vocab_size == 1008 and reference.padded_vocab_size == 1000
    loss = model(input_ids, labels)
    assert loss.shape == (B, S) and loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    loss.mean().backward()

    worst: dict[str, float] = {}
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad
        if getattr(param, "sequence_parallel", False):  # finalize_model_grads' job: sum the sequence slices
            assert sequence_parallel
            grad = grad.clone()
            dist.all_reduce(grad, group=state.groups["tp"])
        full = _assemble(param, grad, state.groups["tp"])
        expected = ref_params[name].grad
        if full.shape[0] != expected.shape[0]:  # vocabulary padding rows: never used, never trained
            assert torch.count_nonzero(full[expected.shape[0]:]) == 0, name
            full = full[:expected.shape[0]]
        scale = expected.abs().max()
        torch.testing.assert_close(full, expected, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")
        worst[name] = float(((full - expected).abs().max() / scale))
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_model_matches_single_process(sequence_parallel):
    worst = run_distributed(_tp_matches_tp1, 2, sequence_parallel)
    # every parameter was compared: embedding (the output layer's weight too: tied), 6 per layer (2 norms, qkv,
    # proj, fc1, fc2), final norm
    assert len(worst[0]) == 1 + 6 * TINY.num_layers + 1


def _sp_stage_output_shape(rank: int, world_size: int) -> tuple[int, ...]:
    state = ParallelState.initialize(tp=world_size)
    # A first stage without a pipeline: tied, its embedding would have no last stage to share with.
    first_stage = GPTModel(UNTIED, state, pre_process=True, post_process=False, layer_numbers=[0],
                           sequence_parallel=True, params_dtype=torch.float32, device="cpu")
    return tuple(first_stage(_tokens()[0]).shape)


@pytest.mark.slow
def test_sequence_parallel_stage_output_is_sequence_sharded():
    assert run_distributed(_sp_stage_output_shape, 2) == [(S // 2, B, TINY.hidden_size)] * 2


def _run_stages(chunks_in_order: list[GPTModel], input_ids, labels) -> torch.Tensor:
    """Run pipeline chunks one after another in this process, as the schedules would across ranks."""
    received = None
    for chunk in chunks_in_order:
        if received is not None:
            chunk.set_input_tensor([received])
        out = chunk(input_ids if chunk.pre_process else None, labels if chunk.post_process else None)
        # What the P2P communicator would deliver: the activation, detached, as a new leaf needing grad.
        received = out.detach().requires_grad_() if not chunk.post_process else None
        chunk.sent = out
    return out


def _global_name(chunk: GPTModel, local_name: str) -> str:
    """decoder.layers.{index in this chunk}.x -> decoder.layers.{global layer number}.x"""
    parts = local_name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number)
    return ".".join(parts)


def _backward_stages(chunks_in_order: list[GPTModel], loss: torch.Tensor) -> None:
    loss.mean().backward()
    for earlier, later in zip(reversed(chunks_in_order[:-1]), reversed(chunks_in_order[1:])):
        earlier.sent.backward(later.decoder.input_tensor.grad)


@pytest.mark.parametrize("pp_args", [["--pipeline-model-parallel-size", "2"],
                                     ["--pipeline-model-parallel-size", "2",
                                      "--virtual-pipeline-model-parallel-size", "2"]], ids=["pp2", "pp2-vpp2"])
def test_pipeline_stages_reproduce_whole_model(pp_args):
    # Untied: tied stages start their copy from an all-reduce over the embedding group (tests/test_pipeline_parity).
    run_config = parse_args(["--model", "tiny", "--global-batch-size", "2", "--untie-embeddings-and-output-weights",
                             *pp_args], world_size=2)
    input_ids, labels = _tokens(1)
    whole = _whole_model(_single_process_state(), config=UNTIED)
    ref_loss = whole(input_ids, labels)
    ref_loss.mean().backward()

    per_stage = [build_model_chunks(run_config, _single_process_state(2, stage), "cpu") for stage in (0, 1)]
    # Model order: stage 0 chunk 0, stage 1 chunk 0, stage 0 chunk 1, stage 1 chunk 1.
    in_order = [per_stage[stage][chunk] for chunk in range(len(per_stage[0])) for stage in (0, 1)]
    assert [c.pre_process for c in in_order] == [True] + [False] * (len(in_order) - 1)
    assert [c.post_process for c in in_order] == [False] * (len(in_order) - 1) + [True]
    loss = _run_stages(in_order, input_ids, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    _backward_stages(in_order, loss)

    whole_grads = {name: p.grad for name, p in whole.named_parameters()}
    for chunk in in_order:
        for local_name, param in chunk.named_parameters():
            name = _global_name(chunk, local_name)
            torch.testing.assert_close(param.grad, whole_grads[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("flags, vocab_matrices, expected", [([], 1, 1_235_814_400),
                                                             (["--untie-embeddings-and-output-weights"], 2,
                                                              1_498_482_688)], ids=["tied", "untied"])
def test_llama32_1b_parameter_count_matches_the_reference_run(flags, vocab_matrices, expected):
    run_config = parse_args(["--model", "llama3.2-1b", *flags], world_size=1)
    (model,) = build_model_chunks(run_config, _single_process_state(), "meta")
    m = run_config.model
    h, f, v, kv = m.hidden_size, m.ffn_hidden_size, m.vocab_size, m.kv_channels
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # Q and O, K and V, gate/up/down, two RMSNorms
    assert per_layer == 60_821_504
    assert sum(p.numel() for p in model.decoder.layers[0].parameters()) == per_layer
    total = m.num_layers * per_layer + vocab_matrices * v * h + h  # + embedding (and output layer), + final norm
    assert total == expected  # tied: the real Llama-3.2-1B; untied: as the reference run runs it
    assert sum(p.numel() for p in model.parameters()) == total


def test_tied_output_layer_multiplies_by_the_embedding_weight():
    tied = _whole_model(_single_process_state())
    assert tied.output_layer.weight is None and "output_layer.weight" not in dict(tied.named_parameters())
    hidden = {}
    tied.output_layer.register_forward_hook(lambda module, args, out: hidden.update(x=args[0]))
    logits = tied(_tokens()[0])  # [s, b, V]: the final norm's output [s, b, h] times the embedding [V, h], transposed
    torch.testing.assert_close(logits, hidden["x"] @ tied.embedding.weight.t())


def _untied_twin(tied: GPTModel) -> GPTModel:
    """The untied model with the tied one's weights, its output layer holding a copy of the embedding."""
    untied = _whole_model(_single_process_state(), config=UNTIED)
    state = tied.state_dict() | {"output_layer.weight": tied.embedding.weight.detach().clone()}
    untied.load_state_dict(state)
    return untied


def test_tied_embedding_gradient_sums_both_uses():
    tied = _whole_model(_single_process_state())
    untied = _untied_twin(tied)
    input_ids, labels = _tokens()
    tied_loss, untied_loss = tied(input_ids, labels), untied(input_ids, labels)
    torch.testing.assert_close(tied_loss, untied_loss)
    tied_loss.mean().backward()
    untied_loss.mean().backward()
    both = untied.embedding.weight.grad + untied.output_layer.weight.grad
    torch.testing.assert_close(tied.embedding.weight.grad, both)


@pytest.mark.parametrize("lookup_fusion", [True, False])
def test_tied_embedding_gradient_under_ddp_grad_accumulation_fusion(lookup_fusion):
    """DDP's main_grad gets both uses' gradients. The output layer's GEMM adds its part itself (gradient-accumulation
    fusion); so does the lookup (its rows, index_put_), leaving autograd the linear's placeholder, which DDP's hook
    drops; with the lookup's fusion off (--no-embedding-gradient-accumulation-fusion) the linear hands autograd zeros
    (Megatron's zero_out_wgrad) to sum with the lookup's dense gradient, which the hook adds."""
    tied = _whole_model(_single_process_state())
    set_embedding_gradient_fusion([tied], lookup_fusion)
    assert getattr(tied.embedding.weight, "zero_out_wgrad", False) is not lookup_fusion
    untied = _untied_twin(tied)
    input_ids, labels = _tokens()
    untied(input_ids, labels).mean().backward()
    with world_of_one():
        ddp = DistributedDataParallel(DistributedDataParallelConfig(grad_reduce_in_fp32=True), tied,
                                      ParallelState.initialize())
        ddp(input_ids, labels).mean().backward()
    both = untied.embedding.weight.grad + untied.output_layer.weight.grad
    torch.testing.assert_close(tied.embedding.weight.main_grad, both)
    assert tied.embedding.weight.grad is None  # the hook dropped what autograd held


def test_the_lookup_adds_its_rows_into_main_grad_and_leaves_no_dense_gradient():
    """Untied, two micro-batches under DDP: the embedding's main_grad is the sum of the dense gradients autograd
    gives the same model without DDP, while the weight never holds a [V, h] gradient; repeated ids are summed."""
    model = _whole_model(_single_process_state(), config=UNTIED)
    twin = _whole_model(_single_process_state(), config=UNTIED)
    twin.load_state_dict(model.state_dict())
    batches = [_tokens(seed) for seed in (0, 1)]
    for input_ids, _ in batches:
        input_ids[:, 1::2] = input_ids[:, :-1:2]  # every id twice: rows to sum
    for input_ids, labels in batches:
        twin(input_ids, labels).mean().backward()
    handed: list[torch.Tensor | None] = []  # what autograd hands the weight, seen before DDP's hook drops it
    model.embedding.weight.register_post_accumulate_grad_hook(lambda weight: handed.append(weight.grad))
    with world_of_one():
        ddp = DistributedDataParallel(DistributedDataParallelConfig(grad_reduce_in_fp32=True), model,
                                      ParallelState.initialize())
        for input_ids, labels in batches:
            ddp(input_ids, labels).mean().backward()
    assert handed == [None, None]
    torch.testing.assert_close(model.embedding.weight.main_grad, twin.embedding.weight.grad)


def test_bf16_run_builds_bf16_parameters():
    run_config = parse_args(["--model", "tiny", "--bf16"], world_size=1)
    (model,) = build_model_chunks(run_config, _single_process_state(), "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    loss = model(*_tokens())
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()


def _rope_complex(x: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE written independently: pair (x_i, x_{i+d/2}) is the complex number x_i + i x_{i+d/2}, rotated by
    position p times base^(-2i/d). x is [s, d]."""
    s, d = x.shape
    freqs = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(s, dtype=torch.float64)[:, None] * freqs[None, :]
    z = torch.complex(x[:, :d // 2].double(), x[:, d // 2:].double()) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat((z.real, z.imag), dim=-1).float()


def test_attention_follows_the_documented_qkv_layout_rope_gqa_and_causality():
    from engine.tensor_parallel.mappings import TPGroup
    from engine.tensor_parallel.random import MasterWeightInit, scaled_init_std
    from engine.transformer.attention import SelfAttention
    from engine.transformer.rotary import RotaryEmbedding

    n_q, n_kv, d, h = TINY.num_attention_heads, TINY.num_query_groups, TINY.head_dim, TINY.hidden_size
    per_group = n_q // n_kv
    attention = SelfAttention(TINY, "decoder.layers.1.self_attention", tp=TPGroup(None, 1, 0),
                              sequence_parallel=False, params_dtype=torch.float32, device="cpu", seed=1234)
    x = torch.randn(S, 1, h, generator=torch.Generator().manual_seed(3))
    cos, sin = RotaryEmbedding(d, TINY.rotary_base)(S, x.device, x.dtype)
    out = attention(x, cos, sin)

    w_qkv = MasterWeightInit(TINY.init_method_std, 1234, "decoder.layers.1.self_attention.linear_qkv.weight").draw(
        ((n_q + 2 * n_kv) * d, h), torch.device("cpu"))
    w_o = MasterWeightInit(scaled_init_std(TINY.init_method_std, TINY.num_layers), 1234,
                           "decoder.layers.1.self_attention.linear_proj.weight").draw((h, n_q * d), torch.device("cpu"))
    tokens = x[:, 0]
    heads = []
    for g in range(n_kv):
        start = g * (per_group + 2) * d  # group g: its query heads, then its K, then its V
        k = _rope_complex(tokens @ w_qkv[start + per_group * d:start + (per_group + 1) * d].t(), TINY.rotary_base)
        v = tokens @ w_qkv[start + (per_group + 1) * d:start + (per_group + 2) * d].t()
        for j in range(per_group):
            q = _rope_complex(tokens @ w_qkv[start + j * d:start + (j + 1) * d].t(), TINY.rotary_base)
            scores = (q @ k.t()) / d ** 0.5
            scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
            heads.append(scores.softmax(-1) @ v)
    expected = torch.cat(heads, dim=-1) @ w_o.t()
    torch.testing.assert_close(out[:, 0], expected, rtol=1e-4, atol=1e-6)
