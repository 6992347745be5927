"""get_model, as Megatron's training.py has it: the model chunks (one per virtual pipeline stage) built and each
wrapped in DistributedDataParallel, with the probes' memory points after the build and after the DDP buffers. Its own
module so that checkpoint resharding can build a saved layout's model without importing the training loop."""
from __future__ import annotations

from typing import Any

import torch

from common.config import RunConfig
from engine.distributed import DistributedDataParallel, DistributedDataParallelConfig
from engine.models.gpt_model import build_model_chunks
from engine.parallel_state import ParallelState
from probes.protocol import ProbeSetProtocol


def get_model(run_config: RunConfig, parallel_state: ParallelState, device: torch.device,
              probes: ProbeSetProtocol) -> list[DistributedDataParallel]:
    chunks = build_model_chunks(run_config, parallel_state, device, probes)
    probes.memory_point("after_model_build", lambda: held_tensors(chunks))
    ddp_config = DistributedDataParallelConfig.from_train_config(run_config.train, parallel_state.dp_size)
    # As Megatron: only the first model chunk is bucketed; later chunks' reductions run in the cooldown anyway.
    model = [DistributedDataParallel(ddp_config, chunk, parallel_state, probes, disable_bucketing=index > 0)
             for index, chunk in enumerate(chunks)]
    probes.memory_point("after_ddp_buffers", lambda: held_tensors(model))
    return model


def held_tensors(model: list[torch.nn.Module], optimizer: Any = None) -> list[torch.Tensor]:
    """Every tensor the model chunks and the optimizer hold, for the probes' CPU memory census (which sizes each
    storage once): parameters (views into the DDP param buffers once those exist), registered buffers, grads and
    main_grad (views into the grad buffers), the main params and their grads, and torch's optimizer state. Listed
    from the objects themselves, not from the inventory's records, so the census checks those."""
    params = [p for chunk in model for p in chunk.parameters()]
    tensors = params + [b for chunk in model for b in torch.nn.Module.buffers(chunk)]
    tensors += [g for p in params for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]
    if optimizer is not None:
        tensors += [t for m in optimizer.main_params for t in (m, m.grad) if t is not None]
        tensors += [v for state in optimizer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return tensors
