"""torchtitan anchor: its Llama 3 model at Llama-3.2-1B's shape (untied, as the other anchors and our engine's
comparison run build it) through its own `parallelize_llama` and per-block torch.compile, fp32 master weights in
torch's fused AdamW, gradient accumulation over --microbatches, grad-clip 1.0, synthetic tokens; one process
(torchrun or alone). torchtitan's trainer itself is not run: it needs a tokenizer and Hugging Face datasets this
harness does without. Either release, whichever is installed:
  * 0.3.0 (`model_registry("1B")`): FSDP2 with bf16 parameters and fp32 reductions, FlexAttention (0.3.0 has no
    SDPA path for language models; causal masks from the positions it builds). Needs a torch newer than 2.11.
  * 0.2.2 (its `TransformerModelArgs` at the 1B shape): on one GPU its trainer applies no FSDP and trains under
    autocast to bf16 (torchtitan.distributed.utils.maybe_enable_amp), as here; SDPA with the causal flag; no
    activation checkpointing (our run has none). Its llama3 package's __init__ (the train spec: tokenizer, Hugging
    Face dataloader) is not executed: the package is registered empty and only its model and parallelize modules
    are imported. Those still import its data loader's module, which imports Hugging Face `datasets` (pyarrow,
    pandas: more than the device's carry); where `datasets` is not installed, a module of that name is registered
    whose three names raise if called. Nothing here calls them: the tokens are synthetic.

    python torchtitan_anchor.py --seq 4096 --microbatches 8 [--steps 15 --timed 10] [--tiny]

A GPU only (0.3.0's FlexAttention has no backward on CPU; --tiny: torchtitan's debug model, a smoke run).

Prints one line 'RESULT {json}' in the other anchors' format (times, peaks, memory after setup and step 1).
"""
import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
import types
from importlib.metadata import version

import torch
import torch.distributed as dist
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--seq", type=int, default=4096)
p.add_argument("--microbatches", type=int, default=1)
p.add_argument("--steps", type=int, default=15)
p.add_argument("--timed", type=int, default=10)
p.add_argument("--attention", default="flex", choices=("flex", "flex_flash", "varlen"),
               help="torchtitan 0.3.0's attention backends for language models (0.2.2 runs SDPA)")
p.add_argument("--tiny", action="store_true")
args = p.parse_args()
TORCHTITAN = version("torchtitan")
LLAMA_1B = dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
                rope_theta=500000, vocab_size=128256)  # Llama-3.2-1B: f = 8192
TINY = dict(dim=256, n_layers=6, n_heads=16, vocab_size=2048, rope_theta=500000)  # torchtitan's debugmodel


def build_0_3(device: torch.device):
    """(model, vocabulary, forward(tokens) -> logits, autocast) with torchtitan 0.3.0's registry and FSDP2."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel" if args.tiny else "1B", attn_backend=args.attention)
    config = spec.model
    config.enable_weight_tying = False
    training = TrainingConfig(local_batch_size=1, seq_len=args.seq, global_batch_size=args.microbatches)
    parallelism = ParallelismConfig()
    with torch.device("meta"):
        model = config.build()
    model = spec.parallelize_fn(model, parallel_dims=ParallelDims.from_config(parallelism, world_size=1),
                                training=training, parallelism=parallelism,
                                compile_config=CompileConfig(enable=True, components=["model", "loss"]),
                                ac_config=None, dump_folder="/tmp/torchtitan_anchor")
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    positions = torch.arange(args.seq, device=device).unsqueeze(0)  # one document a sequence: a causal mask

    def forward(tokens: torch.Tensor) -> torch.Tensor:  # masks per micro-batch, as its trainer builds them
        return model(tokens, positions, model.get_attention_masks(positions=positions))
    return model, config.vocab_size, forward, contextlib.nullcontext


def without_datasets() -> None:
    """Register `datasets` for torchtitan's data-loader module to import, where it is not installed (docstring)."""
    if importlib.util.find_spec("datasets") is not None:
        return

    def not_carried(*_args, **_kwargs):
        raise RuntimeError("Hugging Face datasets is not installed: this harness trains on synthetic tokens")
    datasets, distributed = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
    datasets.Dataset = datasets.load_dataset = distributed.split_dataset_by_node = not_carried
    datasets.distributed = distributed
    sys.modules.update({"datasets": datasets, "datasets.distributed": distributed})


def build_0_2(device: torch.device):
    """(model, vocabulary, forward, autocast) with torchtitan 0.2.2's model args and parallelize_llama, one GPU."""
    without_datasets()
    models = importlib.util.find_spec("torchtitan.models").submodule_search_locations[0]
    package = types.ModuleType("torchtitan.models.llama3")
    package.__path__ = [os.path.join(models, "llama3")]
    sys.modules["torchtitan.models.llama3"] = package  # its __init__ (the train spec) is not run: docstring
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    job = JobConfig()
    job.training.seq_len, job.training.local_batch_size = args.seq, 1
    job.compile.enable, job.compile.components = True, ["model", "loss"]
    job.activation_checkpoint.mode = "none"
    job.job.dump_folder = "/tmp/torchtitan_anchor"
    model_args = TransformerModelArgs(**(TINY if args.tiny else LLAMA_1B))
    model_args.update_from_config(job)
    with torch.device("meta"):
        model = Transformer(model_args)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    model = parallelize_llama(model, dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model, model_args.vocab_size, model, lambda: torch.autocast("cuda", dtype=torch.bfloat16)


os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29531")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
dist.init_process_group("nccl")
model, vocab, forward, autocast = (build_0_3 if TORCHTITAN.startswith("0.3") else build_0_2)(device)
model.train()
n_params = sum(p.numel() for p in model.parameters())


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


loss_fn = torch.compile(loss_of)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
gen = torch.Generator(device=device).manual_seed(0)
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
        with autocast():
            loss = loss_fn(forward(tokens[:, :-1]), tokens[:, 1:]) / args.microbatches
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
                              "torch": torch.__version__, "torchtitan": TORCHTITAN}))
dist.destroy_process_group()
