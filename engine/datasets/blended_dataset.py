"""Megatron's weighted blend of datasets (`--data-path 0.7 A 0.3 B`): sample i comes from the dataset whose share
so far lags its weight the most (helpers.cpp's build_blending_indices), so every prefix of the blend follows the
weights as closely as whole samples allow, and the order is the same on every rank without any randomness. The loop
is Python, one step per sample, so its two indices are cached like the GPT indices (engine.datasets.cache)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from engine.datasets.cache import IndexCache

BLEND_INDEX_NAMES = ("dataset_index", "dataset_sample_index")
SURPLUS = 0.005  # Megatron's mid_level_dataset_surplus: each dataset builds a little more than its share


def samples_per_dataset(weights: Sequence[float], size: int) -> list[int]:
    """How many samples to build in each dataset so that a blend of `size` never runs out."""
    return [int(math.ceil(math.ceil(size * w) * (1 + SURPLUS))) for w in weights]


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of sample i, its sample number in that dataset), for i < size."""
    weights_ = np.asarray(weights, dtype=np.float64)
    taken = np.zeros(len(weights_), dtype=np.int64)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):
        lag = weights_ * max(i, 1) - taken  # ties go to the first dataset, as in helpers.cpp
        d = int(np.argmax(lag))
        dataset_index[i], sample_index[i] = d, taken[d]
        taken[d] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """The blend of `datasets` (GPTDatasets, whose `description` keys the cache entry with the weights and size)."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, cache: IndexCache | None = None):
        self.datasets = list(datasets)
        description = {"class": "BlendedDataset", "weights": list(weights), "size": size,
                       "datasets": [d.description for d in self.datasets]}
        indices = cache.load(description, BLEND_INDEX_NAMES) if cache is not None else None
        if indices is None:
            indices = dict(zip(BLEND_INDEX_NAMES, build_blending_indices(weights, size)))
            if cache is not None:
                cache.save(description, indices)
        self.dataset_index, self.sample_index = (indices[n] for n in BLEND_INDEX_NAMES)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.datasets[self.dataset_index[index]][int(self.sample_index[index])]
