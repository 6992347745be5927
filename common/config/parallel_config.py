"""The parallel layout (Megatron's ModelParallelConfig and the world size), and the check it makes alone."""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import ConfigError


@dataclass
class ParallelConfig:
    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    # Experts are laid out on a grid of their own (Megatron's expert rank generator): tp x ep x expert-dp x pp, where
    # expert-dp = world / (tp x ep x pp) (the expert tensor-parallel size is tp, Megatron's default).
    expert_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    # Uneven stages (Megatron-LM's flags): the first / last stage's own layer count, the rest split evenly between.
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    # ...or the embedding / the loss counted as a layer of the first / last virtual stage (Megatron-LM's flags).
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # ...or every virtual stage spelled out (Megatron's --pipeline-model-parallel-layout); it sets the virtual size.
    pipeline_model_parallel_layout: str | None = None
    sequence_parallel: bool = False
    order: str = "tp-cp-ep-dp-pp"
    # Not a flag: what the engine that wrote a manifest did. Today's builds an NCCL communicator only for a process
    # group of more than one rank; manifests from before this field were written by an engine that built one for
    # every group, one rank or more (RunConfig.from_dict), which the ledger's device-memory formula counts.
    communicators_for_groups_of_one: bool = False

    @property
    def data_parallel_size(self) -> int:
        model_parallel = (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                          * self.context_parallel_size)
        return self.world_size // model_parallel if model_parallel > 0 else 0  # sizes < 1: validate refuses them

    @property
    def expert_data_parallel_size(self) -> int:
        """The ranks holding the same experts, over which expert gradients are reduced (Megatron's expt_dp)."""
        expert_parallel = (self.tensor_model_parallel_size * self.expert_model_parallel_size
                           * self.pipeline_model_parallel_size)
        return self.world_size // expert_parallel if expert_parallel > 0 else 0


def check_parallel(p: ParallelConfig) -> None:
    """The model-parallel grid tiles the world."""
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    if p.world_size % model_parallel:
        raise ConfigError(f"world size {p.world_size} is not divisible by tp {p.tensor_model_parallel_size} x "
                          f"pp {p.pipeline_model_parallel_size} x cp {p.context_parallel_size} = {model_parallel}")
