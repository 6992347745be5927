"""The training batches: Megatron-format data (--data-path, engine.datasets) or deterministic mock data.

Mock data (--mock-data, the default without --data-path) gives the same global batch whatever the parallel layout.

Sample k is a pure function of (seed, k), so a TP=2 x DP=2 run and a single-process run see the same tokens and
their loss curves can be compared number for number. Global batch i holds samples [i*G, (i+1)*G); data-parallel
rank d takes its contiguous share [d*G/D, (d+1)*G/D), cut into micro-batches of [mbs, seq]. Every TP rank of a group
builds the same batch itself, so no broadcast is needed (Megatron broadcasts from TP rank 0 for real data). Real
data is cut the same way: sample k of the global order is sample k of the GPT dataset (or blend), which every rank
indexes identically from the flags.

The tokens are random but not noise: every odd position is a fixed, seeded permutation of the token before it, so the
loss has something to learn and a falling curve shows that training works.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from common.config import RunConfig
from engine.datasets.builder import build_train_dataset

_MIX = 0x9E3779B97F4A7C15  # Weyl constant: spreads (seed, index) over the generator's 63-bit seed space


@dataclass
class MicroBatch:
    tokens: torch.Tensor | None  # [mbs, seq] int64; only the first pipeline stage reads it
    labels: torch.Tensor | None  # [mbs, seq] int64, the next tokens; only the last pipeline stage reads it


class MockGPTDataset:
    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        g = torch.Generator().manual_seed(seed)
        self.successor = torch.randperm(vocab_size, generator=g)

    def __getitem__(self, index: int) -> torch.Tensor:
        """seq_length + 1 tokens: the inputs and, shifted by one, the labels."""
        g = torch.Generator().manual_seed((self.seed * _MIX + index) % 2**63)
        tokens = torch.randint(self.vocab_size, (self.seq_length + 1,), generator=g)
        odd = tokens[1::2]
        odd.copy_(self.successor[tokens[0::2][: odd.numel()]])
        return tokens


class TokenSamples:
    """A numpy dataset of engine.datasets (GPTDataset, BlendedDataset) as the int64 tensors the iterator stacks."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.dataset[index])


def micro_batch_samples(iteration: int, microbatch: int, dp_rank: int, dp_size: int, micro_batch_size: int,
                        global_batch_size: int) -> range:
    """The global sample indices of one micro-batch of one data-parallel rank."""
    start = iteration * global_batch_size + dp_rank * (global_batch_size // dp_size) + microbatch * micro_batch_size
    return range(start, start + micro_batch_size)


class MockDataIterator(Iterator[MicroBatch]):
    """The micro-batches of one model chunk, in schedule order: num_microbatches per iteration, then the next."""

    def __init__(self, dataset: MockGPTDataset | TokenSamples, run_config: RunConfig, dp_rank: int, dp_size: int,
                 device: torch.device, *, needs_tokens: bool, needs_labels: bool):
        self.dataset, self.dp_rank, self.dp_size, self.device = dataset, dp_rank, dp_size, device
        self.micro_batch_size = run_config.train.micro_batch_size
        self.global_batch_size = run_config.train.global_batch_size
        self.num_microbatches = run_config.num_microbatches
        self.needs_tokens, self.needs_labels = needs_tokens, needs_labels
        self.position = 0

    def __next__(self) -> MicroBatch:
        iteration, microbatch = divmod(self.position, self.num_microbatches)
        self.position += 1
        if not (self.needs_tokens or self.needs_labels):
            return MicroBatch(None, None)
        samples = micro_batch_samples(iteration, microbatch, self.dp_rank, self.dp_size, self.micro_batch_size,
                                      self.global_batch_size)
        batch = torch.stack([self.dataset[k] for k in samples])
        if self.device.type == "cuda":
            batch = batch.pin_memory().to(self.device, non_blocking=True)
        return MicroBatch(tokens=batch[:, :-1] if self.needs_tokens else None,
                          labels=batch[:, 1:] if self.needs_labels else None)


def build_data_iterators(run_config: RunConfig, parallel_state, device: torch.device) -> list[MockDataIterator]:
    """One iterator per model chunk (virtual stage); a chunk reads tokens only as the first stage, labels as the last."""
    model = run_config.model
    if run_config.train.data_path is not None:
        dataset = TokenSamples(build_train_dataset(run_config))
    else:
        dataset = MockGPTDataset(model.vocab_size, model.seq_length, run_config.train.seed)
    vpp = parallel_state.virtual_pipeline_size or 1
    ps = parallel_state
    return [MockDataIterator(dataset, run_config, ps.dp_rank, ps.dp_size, device,
                             needs_tokens=ps.is_pipeline_first_stage and chunk == 0,
                             needs_labels=ps.is_pipeline_last_stage and chunk == vpp - 1)
            for chunk in range(vpp)]
