"""megatron-core anchor benchmark: Llama-3.2-1B shape ("train-ledger"), 1 GPU.

Usage: python mcore_anchor.py --seq 4096 --attn {local,sdpa} [--microbatches 8] [--fusedadam] [--steps 15 --timed 10]
Prints one line 'RESULT {json}'.
"""
import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--seq", type=int, default=4096)
p.add_argument("--mbs", type=int, default=1)
p.add_argument("--microbatches", type=int, default=1)  # gradient accumulation per step
p.add_argument("--attn", default="local", choices=["local", "sdpa"])
p.add_argument("--steps", type=int, default=15)
p.add_argument("--timed", type=int, default=10)
p.add_argument("--distopt", type=int, default=1)
p.add_argument("--fusedadam", action="store_true")  # patch torch AdamW -> fused=True
p.add_argument("--moe", action="store_true")  # mixtral-8x7b-2l: 8 experts, top-2, SequentialMLP (no grouped GEMM)
p.add_argument("--tiny", action="store_true")  # CPU smoke test of construction only
p.add_argument("--cpu", action="store_true")
args = p.parse_args()

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + (os.getpid() % 1000)))
os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import megatron.core  # noqa: E402 (after the environment above)
from megatron.core import parallel_state  # noqa: E402 (after the environment above)
from megatron.core.models.gpt import GPTModel  # noqa: E402 (after the environment above)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402 (after the environment above)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402 (after the environment above)
from megatron.core.transformer.module import Float16Module, MegatronModule  # noqa: E402 (after the environment above)
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402 (after the environment above)

# Llama-3.2-1B / train-ledger shape; --moe: train-ledger's mixtral-8x7b-2l (Mixtral 8x7B's layer, 2 layers)
L, H, FFN, NH, NKV, V = 16, 2048, 8192, 32, 8, 128256
EXPERTS, TOPK, ROTARY_BASE, ROPE_SCALING = None, 2, 500000, True
if args.moe:
    L, H, FFN, NH, NKV, V = 2, 4096, 14336, 32, 8, 32000
    EXPERTS, ROTARY_BASE, ROPE_SCALING = 8, 1000000, False
if args.tiny:
    L, H, FFN, NH, NKV, V = 2, 256, 1024, 4, 2, 1000
    EXPERTS = 4 if args.moe else None
HD = H // NH


class SDPACoreAttention(MegatronModule):
    """Drop-in core_attention for the local spec using torch SDPA (flash/cuDNN backend).
    Inputs q [sq,b,np,hn], k/v [sk,b,ng,hn]; output [sq,b,np*hn] like DotProductAttention."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None, **kw):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        q = query.permute(1, 2, 0, 3)  # [b,np,sq,hn]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                           enable_gqa=(q.size(1) != k.size(1)))
        sq, b = query.size(0), query.size(1)
        return o.permute(2, 0, 1, 3).reshape(sq, b, -1)


def main():
    if not args.cpu:
        torch.cuda.set_device(0)
    torch.distributed.init_process_group(backend="gloo" if args.cpu else "nccl", world_size=1, rank=0)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if not args.cpu:
        model_parallel_cuda_manual_seed(1234)

    cfg = TransformerConfig(
        num_layers=L, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=NH,
        num_query_groups=NKV, kv_channels=HD, normalization="RMSNorm", layernorm_epsilon=1e-5,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, init_method_std=0.02,
        gradient_accumulation_fusion=False,  # needs apex fused_weight_gradient_mlp_cuda
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        bias_activation_fusion=False, bias_dropout_fusion=False,
        attention_softmax_in_fp32=True, use_cpu_initialization=args.cpu,
        **(dict(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_aux_loss_coeff=0.02,
                moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="alltoall",
                moe_grouped_gemm=False) if EXPERTS else {}),
    )
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm")
    if args.attn == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=V,
                     max_sequence_length=args.seq, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=ROTARY_BASE, rope_scaling=ROPE_SCALING, rope_scaling_factor=32.0,
                     parallel_output=True)
    n_params = sum(p.numel() for p in model.parameters())
    print("params", n_params, "dtype", next(model.parameters()).dtype, flush=True)
    if args.tiny:
        torch.cuda.current_device = lambda: "cpu"  # CPU smoke only
        toks = torch.randint(0, V, (1, 33))
        pos = torch.arange(32).unsqueeze(0)
        out = model(toks[:, :-1], pos, None, labels=toks[:, 1:])
        print("loss shape", out.shape, out.dtype, float(out.float().mean()))
        out.float().mean().backward()
        print("TINY OK")
        return
    model = model.cuda()
    model = Float16Module(cfg, model)

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=bool(args.distopt))
    model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt_cfg = OptimizerConfig(optimizer="adam", lr=3e-4, min_lr=3e-5, weight_decay=0.1,
                              adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, bf16=True,
                              params_dtype=torch.bfloat16, use_distributed_optimizer=bool(args.distopt),
                              clip_grad=1.0)
    if args.fusedadam:
        _AdamW = torch.optim.AdamW

        class FusedAdamW(_AdamW):
            def __init__(self, *a, **k):
                k["fused"] = True
                super().__init__(*a, **k)
        torch.optim.AdamW = FusedAdamW
    optimizer = get_megatron_optimizer(opt_cfg, [model])
    inner = getattr(optimizer, "optimizer", None)
    print("optimizer", type(optimizer).__name__, type(inner).__name__,
          {k: v for k, v in getattr(inner, "defaults", {}).items()
           if k in ("fused", "foreach", "betas", "weight_decay")}, flush=True)
    torch.cuda.synchronize()
    ms = torch.cuda.memory_stats()
    mem_setup = dict(alloc=ms["allocated_bytes.all.current"], reserved=ms["reserved_bytes.all.current"])
    print("after setup", mem_setup, flush=True)

    S, B = args.seq, args.mbs
    g = torch.Generator(device="cuda").manual_seed(0)
    pos = torch.arange(S, device="cuda").unsqueeze(0).expand(B, S)
    loss_mask = torch.ones(B, S, device="cuda", dtype=torch.float)

    def data_iter():
        while True:
            toks = torch.randint(0, V, (B, S + 1), device="cuda", generator=g)
            yield toks[:, :-1].contiguous(), toks[:, 1:].contiguous()

    def loss_func(output_tensor):
        losses = output_tensor.float()
        loss = torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum()
        return loss, {"lm loss": loss.detach()}

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        out = model(tokens, pos, None, labels=labels)
        return out, loss_func

    fb = get_forward_backward_func()
    it = data_iter()
    times, losses, gnorms, t_fb, t_opt = [], [], [], [], []
    mem_after_step1 = None
    torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        ld = fb(forward_step_func=forward_step, data_iterator=it, model=[model], num_microbatches=args.microbatches,
                seq_length=S, micro_batch_size=B, decoder_seq_length=S, forward_only=False)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        ok, gn, _ = optimizer.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        t_fb.append(t1 - t0)
        t_opt.append(times[-1] - (t1 - t0))
        # each micro-batch entry is already divided by num_microbatches
        losses.append(sum(float(d["lm loss"]) for d in ld))
        gnorms.append(float(gn) if gn is not None else None)
        if step == 0:
            ms = torch.cuda.memory_stats()
            mem_after_step1 = dict(alloc=ms["allocated_bytes.all.current"],
                                   reserved=ms["reserved_bytes.all.current"])
        print(f"step {step} {times[-1]*1e3:.1f} ms loss {losses[-1]:.4f} gnorm {gnorms[-1]}", flush=True)
    ms = torch.cuda.memory_stats()
    tt = times[-args.timed:]
    step_s = sum(tt) / len(tt)
    res = dict(variant=f"mcore-{args.attn}-distopt{args.distopt}" + ("-fusedadam" if args.fusedadam else "")
               + ("-moe" if args.moe else ""),
               fb_s=sum(t_fb[-args.timed:]) / args.timed, opt_s=sum(t_opt[-args.timed:]) / args.timed,
               seq=S, mbs=B, n_params=n_params,
               step_s=step_s, step_min_s=min(tt), tokens_per_s=B * S * args.microbatches / step_s,
               microbatches=args.microbatches,
               mem_setup=mem_setup, mem_after_step1=mem_after_step1,
               peak_alloc=ms["allocated_bytes.all.peak"], peak_reserved=ms["reserved_bytes.all.peak"],
               losses=losses, gnorms=gnorms, times=times,
               megatron_core=megatron.core.__version__, torch=torch.__version__,
               optimizer_cls=type(optimizer).__name__,
               inner_opt=type(getattr(optimizer, "optimizer", None)).__name__)
    print("RESULT " + json.dumps(res), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
