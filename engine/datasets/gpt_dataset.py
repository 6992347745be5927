"""Megatron's GPT samples over an indexed dataset: seq_length + 1 tokens each, cut across document boundaries.

As Megatron Core's GPTDataset builds them (gpt_dataset.py and helpers.cpp's build_sample_idx):
- the split's documents are repeated for as many epochs as the requested samples need and shuffled with
  numpy.random.RandomState(seed) (the document index). When the last epoch is needed for less than 80% of its
  samples, it is shuffled separately, so that its partial use does not favour a random subset of all epochs;
- the shuffled documents are read as one stream of tokens; sample k is stream[k*seq, k*seq + seq + 1): consecutive
  samples share one token, the label of the last input. The sample index records where each sample starts, as
  (position in the document index, token offset in that document); partial last samples are dropped;
- the samples are shuffled (the shuffle index), again separately for a separate last epoch.
The three indices are cached beside the data as Megatron caches them (engine.datasets.cache), keyed by the .idx they
were built from (it alone decides them: the lengths and documents), the split's documents, the sample count, the
sequence length and the seed.
Like Megatron, a document is read as the sequence of the same number (datasets written one sequence per document,
as tools/preprocess_data.py writes them without --split-sentences).
"""
from __future__ import annotations

import hashlib

import numpy as np

from common.errors import ConfigError
from engine.datasets.cache import IndexCache, file_identity
from engine.datasets.indexed_dataset import IndexedDataset, idx_path

LAST_EPOCH_THRESHOLD = 0.80  # Megatron's: a last epoch used for fewer of its samples is shuffled on its own


def split_documents(num_documents: int, split: tuple[float, float, float]) -> list[np.ndarray]:
    """The document ids of train, valid and test: consecutive ranges, bounds rounded as Megatron rounds them."""
    bounds = np.concatenate(([0.0], np.cumsum(split)))
    return [np.arange(int(round(lo * num_documents)), int(round(hi * num_documents)), dtype=np.int32)
            for lo, hi in zip(bounds[:-1], bounds[1:])]


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_last_epoch: bool) -> np.ndarray:
    """The documents of every epoch, shuffled together (or the last epoch on its own), int32."""
    if separate_last_epoch and num_epochs > 1:
        return np.concatenate((build_document_index(documents, num_epochs - 1, rng, False),
                               build_document_index(documents, 1, rng, False)))
    index = np.tile(documents.astype(np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """[num_samples + 1, 2]: row k = (position in document_index, offset) of stream token k * seq_length, the first
    token of sample k and the last (the extra label token) of sample k - 1."""
    ends = np.cumsum(sizes[document_index], dtype=np.int64)
    starts = ends - sizes[document_index]
    num_samples = (int(ends[-1]) - 1) // seq_length
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    where = np.searchsorted(ends, positions, side="right")  # the first document that ends after the position
    index = np.stack((where, positions - starts[where]), axis=1)
    index[0] = 0  # helpers.cpp starts at (0, 0) even when the first document is empty: the same tokens
    return index


def build_shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, total) that shuffles [0, num_samples) and [num_samples, total) each on its own."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


def build_indices(sizes: np.ndarray, documents: np.ndarray, tokens_per_epoch: int, num_samples: int,
                  seq_length: int, seed: int) -> dict[str, np.ndarray]:
    """The document, sample and shuffle indices of at least num_samples samples (INDEX_NAMES order)."""
    num_epochs = -(-(num_samples * seq_length + 1) // tokens_per_epoch)  # ceil: enough tokens for the samples
    before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    separate_last = (num_epochs > 1 and
                     num_samples - before_last < int(LAST_EPOCH_THRESHOLD * per_epoch))
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_last)
    sample_index = build_sample_index(sizes, document_index, seq_length)
    total = len(sample_index) - 1
    shuffle_index = build_shuffle_index(before_last if separate_last else total, total, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


class GPTDataset:
    """At least num_samples samples of seq_length + 1 tokens from `documents` of `dataset`, in a seeded order. With
    a cache (engine.datasets.cache) the indices are read from it when it holds them for this description, else built
    and offered to it."""

    def __init__(self, dataset: IndexedDataset, documents: np.ndarray, num_samples: int, seq_length: int,
                 seed: int, cache: IndexCache | None = None):
        self.dataset, self.seq_length = dataset, seq_length
        tokens_per_epoch = int(dataset.sequence_lengths[documents].astype(np.int64).sum())
        if tokens_per_epoch < 2:  # as helpers.cpp asserts: a sample needs an input and a label
            raise ConfigError(f"--data-path {dataset.prefix}: the training split (--split) holds {tokens_per_epoch} "
                              "tokens; it needs at least 2")
        self.description = {"class": "GPTDataset", "index": file_identity(idx_path(dataset.prefix)),
                            "documents_md5": hashlib.md5(np.ascontiguousarray(documents, np.int32).tobytes(),
                                                         usedforsecurity=False).hexdigest(),
                            "num_samples": num_samples, "seq_length": seq_length, "seed": seed,
                            "last_epoch_threshold": LAST_EPOCH_THRESHOLD}
        indices = cache.load(self.description, INDEX_NAMES) if cache is not None else None
        self.from_cache = indices is not None
        if indices is None:
            indices = build_indices(dataset.sequence_lengths, documents, tokens_per_epoch, num_samples, seq_length,
                                    seed)
            if cache is not None:
                cache.save(self.description, indices)
        self.document_index, self.sample_index, self.shuffle_index = (indices[n] for n in INDEX_NAMES)

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, index: int) -> np.ndarray:
        """seq_length + 1 int64 tokens: the inputs and, shifted by one, the labels."""
        k = int(self.shuffle_index[index])
        (first, offset), (last, end) = self.sample_index[k], self.sample_index[k + 1]
        docs = self.document_index
        if first == last:
            return self.dataset.get(int(docs[first]), int(offset), int(end - offset + 1)).astype(np.int64)
        parts = [self.dataset.get(int(docs[first]), int(offset))]
        parts += [self.dataset.get(int(docs[i])) for i in range(first + 1, last)]
        parts.append(self.dataset.get(int(docs[last]), 0, int(end + 1)))
        return np.concatenate(parts).astype(np.int64)
