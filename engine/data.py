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

Either way the training loop never builds a batch itself: MicroBatchIterator takes them from a background thread
that builds them ahead (engine.data_loader), and measures how long it waited (docs/engine.md, "Data").
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch

from common.config import RunConfig
from engine.context_parallel import get_batch_on_this_cp_rank
from engine.data_loader import Prefetcher
from engine.datasets.builder import build_train_dataset
from probes.probe_set import NullProbeSet
from probes.protocol import ProbeSetProtocol

_MIX = 0x9E3779B97F4A7C15  # Weyl constant: spreads (seed, index) over the generator's 63-bit seed space
PREFETCH_MIN = 2  # micro-batches built ahead at least; else two iterations', refilled one iteration at a time


@dataclass
class MicroBatch:
    tokens: torch.Tensor | None  # [mbs, seq / cp] int64; only the first pipeline stage reads it
    labels: torch.Tensor | None  # [mbs, seq / cp] int64, the next tokens; only the last pipeline stage reads it


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


class HostBatches:
    """position (the n-th micro-batch of the schedule order) -> its [mbs, seq + 1] int64 tokens on the host, pinned
    for an asynchronous copy when the device is CUDA. What the loader's thread runs."""

    def __init__(self, dataset: MockGPTDataset | TokenSamples, run_config: RunConfig, dp_rank: int, dp_size: int,
                 pin: bool):
        self.dataset, self.dp_rank, self.dp_size, self.pin = dataset, dp_rank, dp_size, pin
        self.micro_batch_size = run_config.train.micro_batch_size
        self.global_batch_size = run_config.train.global_batch_size
        self.num_microbatches = run_config.num_microbatches

    def __call__(self, position: int) -> torch.Tensor:
        iteration, microbatch = divmod(position, self.num_microbatches)
        samples = micro_batch_samples(iteration, microbatch, self.dp_rank, self.dp_size, self.micro_batch_size,
                                      self.global_batch_size)
        batch = torch.stack([self.dataset[k] for k in samples])
        return batch.pin_memory() if self.pin else batch


class MicroBatchIterator(Iterator[MicroBatch]):
    """The micro-batches of one model chunk, in schedule order: num_microbatches per iteration, then the next.

    A background Prefetcher (engine.data_loader) builds them ahead, up to two iterations'; `next` takes the next
    one from its queue and copies it to the device (asynchronously from pinned memory on CUDA). `position` is the
    number of micro-batches served: a checkpoint saves it, and setting it (a checkpoint restored) restarts the
    prefetcher there, so a resumed run reads the same batches as a straight one. `next` adds the time it blocked on
    the queue to `wait_s` (inside a "data-wait" probe range); `take_wait_s` hands the step's total to the step record.
    A chunk that reads neither tokens nor labels (a middle pipeline stage) runs no thread and never waits.
    Under context parallelism every CP rank of a DP rank builds the same whole samples and keeps its two chunks of
    tokens and labels (engine.context_parallel), after the copy to the device, as Megatron cuts its batch."""

    def __init__(self, dataset: MockGPTDataset | TokenSamples, run_config: RunConfig, dp_rank: int, dp_size: int,
                 device: torch.device, *, needs_tokens: bool, needs_labels: bool,
                 probes: ProbeSetProtocol | None = None, cp_size: int = 1, cp_rank: int = 0):
        self.device, self.probes = device, probes if probes is not None else NullProbeSet()
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.batches = HostBatches(dataset, run_config, dp_rank, dp_size, pin=device.type == "cuda")
        self.num_microbatches = run_config.num_microbatches
        self.depth = max(PREFETCH_MIN, 2 * self.num_microbatches)
        self.needs_tokens, self.needs_labels = needs_tokens, needs_labels
        self._position = 0
        self._prefetcher: Prefetcher[torch.Tensor] | None = None
        self.wait_s = 0.0

    @property
    def loads(self) -> bool:
        return self.needs_tokens or self.needs_labels

    @property
    def position(self) -> int:
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        self.close()  # what was built ahead belongs to the old position; the next `next` starts from the new one
        self._position = value

    def _start(self, position: int) -> Prefetcher[torch.Tensor]:
        setup = None
        if self.device.type == "cuda":  # the thread pins on this rank's device, not on the thread's default one
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            setup = functools.partial(torch.cuda.set_device, index)
        prefetcher = Prefetcher(self.batches, position, self.depth, setup)
        weakref.finalize(self, prefetcher.close).atexit = False  # at exit the daemon thread just ends with the process
        return prefetcher

    def __next__(self) -> MicroBatch:
        position, self._position = self._position, self._position + 1
        microbatch = position % self.num_microbatches
        if not self.loads:
            return MicroBatch(None, None)
        if self._prefetcher is None:
            self._prefetcher = self._start(position)
        with self.probes.range(f"wait data mb{microbatch}", "data-wait", microbatch=microbatch):
            batch, waited = self._prefetcher.get()
        self.wait_s += waited
        if self.device.type == "cuda":
            batch = batch.to(self.device, non_blocking=True)
        return MicroBatch(tokens=self._on_this_cp_rank(batch[:, :-1]) if self.needs_tokens else None,
                          labels=self._on_this_cp_rank(batch[:, 1:]) if self.needs_labels else None)

    def _on_this_cp_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        return get_batch_on_this_cp_rank(tensor, self.cp_size, self.cp_rank)

    def take_wait_s(self) -> float:
        """The seconds `next` blocked since the last call (the step's data wait), and start counting afresh."""
        waited, self.wait_s = self.wait_s, 0.0
        return waited

    def close(self) -> None:
        """Stop the prefetcher (if one runs); a later `next` starts a new one at `position`."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None


def data_wait_figures(iterators: list[MicroBatchIterator]) -> dict[str, float]:
    """The step record's data_wait_s: the seconds this rank's training loop blocked on its loaders during the step;
    nothing on a rank that reads no data (a middle pipeline stage), which has no wait to judge."""
    if not any(it.loads for it in iterators):
        return {}
    return {"data_wait_s": sum(it.take_wait_s() for it in iterators)}


def build_data_iterators(run_config: RunConfig, parallel_state, device: torch.device,
                         probes: ProbeSetProtocol | None = None) -> list[MicroBatchIterator]:
    """One iterator per model chunk (virtual stage); a chunk reads tokens only as the first stage, labels as the last.
    Only global rank 0 writes the dataset's index caches (the others read them, or build in memory)."""
    model = run_config.model
    if run_config.train.data_path is not None:
        dataset = TokenSamples(build_train_dataset(run_config, write_cache=parallel_state.rank == 0))
    else:
        dataset = MockGPTDataset(model.vocab_size, model.seq_length, run_config.train.seed)
    vpp = parallel_state.virtual_pipeline_size or 1
    ps = parallel_state
    return [MicroBatchIterator(dataset, run_config, ps.dp_rank, ps.dp_size, device,
                               needs_tokens=ps.is_pipeline_first_stage and chunk == 0,
                               needs_labels=ps.is_pipeline_last_stage and chunk == vpp - 1, probes=probes,
                               cp_size=ps.cp_size, cp_rank=ps.cp_rank)
            for chunk in range(vpp)]
