"""torchtitan anchor: its Llama 3 model (`model_registry("1B")`: Llama-3.2-1B's shape, untied here as the other
anchors and our engine's comparison run build it) through its own `parallelize_llama` (FSDP2 with bf16 parameters
and fp32 reductions, per-block torch.compile), its FlexAttention (0.3.0 has no SDPA path for language models; causal
masks from the positions it builds), fp32 master weights in torch's fused AdamW,
gradient accumulation over --microbatches, grad-clip 1.0, synthetic tokens; one process (torchrun or alone).
torchtitan's trainer itself is not run: it needs a tokenizer and Hugging Face datasets this harness does without.

    python torchtitan_anchor.py --seq 4096 --microbatches 8 [--steps 15 --timed 10] [--tiny]

A GPU only: FlexAttention has no backward on CPU (--tiny: torchtitan's debug model, a smoke run on the GPU).

Prints one line 'RESULT {json}' in the other anchors' format (times, peaks, memory after setup and step 1).
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--seq", type=int, default=4096)
p.add_argument("--microbatches", type=int, default=1)
p.add_argument("--steps", type=int, default=15)
p.add_argument("--timed", type=int, default=10)
p.add_argument("--attention", default="flex", choices=("flex", "flex_flash", "varlen"),
               help="torchtitan 0.3.0's attention backends for language models (it dropped SDPA)")
p.add_argument("--tiny", action="store_true")
args = p.parse_args()

import torchtitan  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29531")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
dist.init_process_group("nccl")

spec = model_registry("debugmodel" if args.tiny else "1B", attn_backend=args.attention)
model_config = spec.model
model_config.enable_weight_tying = False
training = TrainingConfig(local_batch_size=1, seq_len=args.seq, global_batch_size=args.microbatches)
parallelism = ParallelismConfig()
compile_config = CompileConfig(enable=True, components=["model", "loss"])

parallel_dims = ParallelDims.from_config(parallelism, world_size=1)
with torch.device("meta"):
    model = model_config.build()
model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                            compile_config=compile_config, ac_config=None, dump_folder="/tmp/torchtitan_anchor")
model.to_empty(device=device)
with torch.no_grad():
    model.init_weights(buffer_device=None)
model.train()
n_params = sum(p.numel() for p in model.parameters())
vocab = model_config.vocab_size


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


loss_fn = torch.compile(loss_of)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
gen = torch.Generator(device=device).manual_seed(0)
positions = torch.arange(args.seq, device=device).unsqueeze(0)  # one document a sequence: a causal mask


def memory() -> dict:
    torch.cuda.synchronize()
    return {"alloc": torch.cuda.memory_allocated()}


mem_setup = memory()
times, losses, mem_after_step1 = [], [], None
for step in range(args.steps):
    torch.cuda.synchronize()
    start = time.perf_counter()
    total = 0.0
    for _ in range(args.microbatches):
        tokens = torch.randint(0, vocab, (1, args.seq + 1), device=device, generator=gen)
        masks = model.get_attention_masks(positions=positions)  # per micro-batch, as its trainer builds them
        loss = loss_fn(model(tokens[:, :-1], positions, masks), tokens[:, 1:]) / args.microbatches
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(float(total))  # reads the loss: the step's end, as the trainer's logging does
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
    if step == 0:
        mem_after_step1 = memory()
print("RESULT " + json.dumps({"times": times[-args.timed:], "losses": losses, "n_params": n_params,
                              "peak_alloc": torch.cuda.max_memory_allocated(),
                              "peak_reserved": torch.cuda.max_memory_reserved(),
                              "mem_setup": mem_setup, "mem_after_step1": mem_after_step1,
                              "torch": torch.__version__, "torchtitan": getattr(torchtitan, "__version__", "0.3.0")}))
dist.destroy_process_group()
