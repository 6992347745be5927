"""--data-path / --split / --seed -> the training samples, after checking the data against the flags.

Every rank builds the same indices from the same flags (they are deterministic), so no rank waits on another and no
index is broadcast; each data-parallel rank then reads only its slice of every global batch (engine.data). Only the
training split is built: this engine does not evaluate.

What costs time at start (the vocabulary scan of every .bin, the GPT and blend indices) is cached beside the data or
in --data-cache-path (engine.datasets.cache). One process writes: the launcher's check_data, which runs before any
rank starts, or global rank 0 under a bare torchrun; the ranks read, so a start after the first scans nothing.
"""
from __future__ import annotations

from common.config import RunConfig
from common.data_flags import parse_blend, parse_split
from common.errors import ConfigError
from engine.datasets.blended_dataset import BlendedDataset, samples_per_dataset
from engine.datasets.cache import IndexCache
from engine.datasets.gpt_dataset import GPTDataset, split_documents
from engine.datasets.indexed_dataset import IndexedDataset


def _cache(run_config: RunConfig, prefix: str, kind: str, write: bool) -> IndexCache:
    return IndexCache.beside(prefix, kind, run_config.train.data_cache_path, write)


def open_datasets(run_config: RunConfig, write_cache: bool = False) -> list[tuple[float, IndexedDataset]]:
    """Each prefix of --data-path opened and checked: the files exist and agree with each other (InputError
    otherwise), and no token id reaches --vocab-size (ConfigError), which would index past the embedding."""
    vocab_size = run_config.model.vocab_size
    opened = []
    for weight, prefix in parse_blend(run_config.train.data_path or []):
        dataset = IndexedDataset(prefix)
        largest = dataset.max_token(_cache(run_config, prefix, "IndexedDataset", write_cache))
        if largest >= vocab_size:
            raise ConfigError(f"--data-path {prefix}: token id {largest} is outside --vocab-size {vocab_size} "
                              "(the tokenizer's vocabulary is larger than the model's)")
        opened.append((weight, dataset))
    return opened


def train_documents(run_config: RunConfig, dataset: IndexedDataset):
    """The document ids of the training split of `dataset` (--split); an empty split is a ConfigError."""
    split = run_config.train.split
    documents = split_documents(dataset.num_documents, parse_split(split))[0]
    if documents.size == 0:
        raise ConfigError(f"--split {split}: the training split of {dataset.prefix} ({dataset.num_documents} "
                          "documents) is empty")
    return documents


def check_data(run_config: RunConfig) -> None:
    """Everything about --data-path that can be wrong, checked without building a sample: for a launcher to call
    before any rank starts (the ranks check it again when they build the dataset, from the caches this writes)."""
    build_train_dataset(run_config, write_cache=True)


def build_train_dataset(run_config: RunConfig, write_cache: bool = False):
    """At least train_iters x global_batch_size samples of seq_length + 1 tokens: one GPTDataset, or a blend. Its
    indices come from the caches when they hold them; this process writes what it builds when `write_cache`."""
    t = run_config.train
    size = t.train_iters * t.global_batch_size
    opened = open_datasets(run_config, write_cache)
    weights = [w for w, _ in opened]
    counts = samples_per_dataset(weights, size) if len(opened) > 1 else [size]
    datasets = [GPTDataset(dataset, train_documents(run_config, dataset), count, run_config.model.seq_length, t.seed,
                           _cache(run_config, dataset.prefix, "GPTDataset", write_cache))
                for (_, dataset), count in zip(opened, counts)]
    if len(datasets) == 1:
        return datasets[0]
    return BlendedDataset(datasets, weights, size, _cache(run_config, opened[0][1].prefix, "BlendedDataset",
                                                          write_cache))
