"""Data parallelism over contiguous param/grad buffers (Megatron Core's megatron/core/distributed/)."""
from engine.distributed.distributed_data_parallel import DistributedDataParallel
from engine.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)
from engine.distributed.finalize_model_grads import finalize_model_grads

__all__ = ["DistributedDataParallel", "DistributedDataParallelConfig", "finalize_model_grads"]
