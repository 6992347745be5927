"""Plain-PyTorch anchor benchmark: Llama-3.2-1B shape ("train-ledger"), 1 GPU.

fp32 params + torch.autocast(bf16) + torch.optim.AdamW(fused=True), SDPA causal attention (GQA via
enable_gqa), grad-clip 1.0. Usage: python torch_anchor.py --seq 4096 [--microbatches 8] [--compile] [--tiny --cpu]
Prints one line 'RESULT {json}'.
"""
import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--seq", type=int, default=4096)
p.add_argument("--mbs", type=int, default=1)
p.add_argument("--microbatches", type=int, default=1)  # gradient accumulation per step
p.add_argument("--steps", type=int, default=15)
p.add_argument("--timed", type=int, default=10)
p.add_argument("--compile", action="store_true")
p.add_argument("--tiny", action="store_true")
p.add_argument("--cpu", action="store_true")
args = p.parse_args()

L, H, FFN, NH, NKV, V, THETA = 16, 2048, 8192, 32, 8, 128256, 500000.0
if args.tiny:
    L, H, FFN, NH, NKV, V = 2, 256, 1024, 4, 2, 1000
HD = H // NH


def rope_cache(S, dev):
    inv = 1.0 / (THETA ** (torch.arange(0, HD, 2, device=dev, dtype=torch.float32) / HD))
    t = torch.arange(S, device=dev, dtype=torch.float32)
    f = torch.outer(t, inv)  # [S, HD/2]
    return f.cos(), f.sin()


def apply_rope(x, cos, sin):  # x [B, h, S, HD], half-split (NeoX/HF Llama) convention
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1 = nn.RMSNorm(H, eps=1e-5)
        self.wq = nn.Linear(H, NH * HD, bias=False)
        self.wk = nn.Linear(H, NKV * HD, bias=False)
        self.wv = nn.Linear(H, NKV * HD, bias=False)
        self.wo = nn.Linear(NH * HD, H, bias=False)
        self.n2 = nn.RMSNorm(H, eps=1e-5)
        self.w1 = nn.Linear(H, FFN, bias=False)
        self.w3 = nn.Linear(H, FFN, bias=False)
        self.w2 = nn.Linear(FFN, H, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        h = self.n1(x)
        q = self.wq(h).view(B, S, NH, HD).transpose(1, 2)
        k = self.wk(h).view(B, S, NKV, HD).transpose(1, 2)
        v = self.wv(h).view(B, S, NKV, HD).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(B, S, H))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.layers = nn.ModuleList([Block() for _ in range(L)])
        self.norm = nn.RMSNorm(H, eps=1e-5)
        self.out = nn.Linear(H, V, bias=False)  # untied

    def forward(self, idx, targets, cos, sin):
        x = self.emb(idx)
        for b in self.layers:
            x = b(x, cos, sin)
        logits = self.out(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, V), targets.view(-1))


def main():
    dev = "cpu" if args.cpu else "cuda"
    torch.manual_seed(0)
    with torch.device(dev):
        model = Llama()
    for n, p_ in model.named_parameters():
        if p_.dim() == 2:
            nn.init.normal_(p_, std=0.02)
    n_params = sum(p_.numel() for p_ in model.parameters())
    print("params", n_params, flush=True)
    decay = [p_ for p_ in model.parameters() if p_.dim() >= 2]
    nodecay = [p_ for p_ in model.parameters() if p_.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=not args.cpu)
    S, B = args.seq, args.mbs
    cos, sin = rope_cache(S, dev)
    fwd = torch.compile(model) if args.compile else model
    if not args.cpu:
        torch.cuda.synchronize()
        ms = torch.cuda.memory_stats()
        mem_setup = dict(alloc=ms["allocated_bytes.all.current"], reserved=ms["reserved_bytes.all.current"])
        print("after setup", mem_setup, flush=True)
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator(device=dev).manual_seed(0)
    times, losses, gnorms, t_fb, t_opt = [], [], [], [], []
    mem_after_step1 = None
    for step in range(args.steps):
        batches = [torch.randint(0, V, (B, S + 1), device=dev, generator=g) for _ in range(args.microbatches)]
        if not args.cpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = 0.0
        for toks in batches:
            with torch.autocast(device_type=dev, dtype=torch.bfloat16):
                mb_loss = fwd(toks[:, :-1], toks[:, 1:], cos, sin) / args.microbatches
            mb_loss.backward()
            loss += mb_loss.detach()
        if not args.cpu:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not args.cpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        t_fb.append(t1 - t0)
        t_opt.append(times[-1] - (t1 - t0))
        losses.append(float(loss))
        gnorms.append(float(gn))
        if step == 0 and not args.cpu:
            ms = torch.cuda.memory_stats()
            mem_after_step1 = dict(alloc=ms["allocated_bytes.all.current"], reserved=ms["reserved_bytes.all.current"])
        print(f"step {step} {times[-1]*1e3:.1f} ms loss {losses[-1]:.4f} gnorm {gnorms[-1]:.3f}", flush=True)
    if args.cpu:
        print("TINY OK")
        return
    ms = torch.cuda.memory_stats()
    tt = times[-args.timed:]
    step_s = sum(tt) / len(tt)
    res = dict(variant="torch-compile" if args.compile else "torch-eager",
               fb_s=sum(t_fb[-args.timed:]) / args.timed, opt_s=sum(t_opt[-args.timed:]) / args.timed,
               seq=S, mbs=B, n_params=n_params,
               step_s=step_s, step_min_s=min(tt), tokens_per_s=B * S * args.microbatches / step_s,
               microbatches=args.microbatches,
               mem_setup=mem_setup, mem_after_step1=mem_after_step1,
               peak_alloc=ms["allocated_bytes.all.peak"], peak_reserved=ms["reserved_bytes.all.peak"],
               losses=losses, gnorms=gnorms, times=times, torch=torch.__version__)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
