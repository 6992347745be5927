"""Index caches beside the data (engine.datasets.cache): the vocabulary scan of a .bin and the GPT and blend indices
are written once, atomically, and read at every later start; a rewritten .bin or .idx, or other flags, miss; a
directory that cannot be written is said once and the run trains anyway; --data-cache-path puts them elsewhere.
The corpora are synthetic (token = 1000 x document + position): they test the plumbing."""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from common.arguments import parse_args
from common.errors import ConfigError
from engine.datasets import cache as cache_mod
from engine.datasets import indexed_dataset
from engine.datasets.builder import build_train_dataset, check_data
from engine.datasets.cache import IndexCache
from engine.datasets.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from tests.support.gloo import world_of_one
from tests.support.parity import train_and_collect

LENGTHS = [5, 0, 7, 3, 11, 1, 4, 9]


def _corpus(prefix: Path, lengths=LENGTHS, top: int = 0) -> None:
    """Written as preprocess writes (temporary names, then renamed). `top` replaces the first token: an id that the
    vocabulary check must see."""
    writer = IndexedDatasetWriter(prefix, np.int32)
    for d, n in enumerate(lengths):
        writer.add_document([top if top and d == 0 and j == 0 else 1000 * d + j for j in range(n)])
    writer.finalize()


def _config(*data_path: str, vocab: int = 8000, extra: tuple[str, ...] = ()):
    return parse_args(["--model", "tiny", "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "8",
                       "--train-iters", "5", "--split", "100,0,0", "--seed", "5", "--vocab-size", str(vocab),
                       "--data-path", *data_path, *extra], world_size=2)


class PoisonedBin:
    """Stands for a .bin map that must not be read: any read fails the test."""
    size = 1

    def __getitem__(self, item):
        raise AssertionError("the .bin was read")


@contextlib.contextmanager
def bin_unreadable(monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(indexed_dataset.IndexedDataset, "_map_bin", lambda self: PoisonedBin())
        yield


def test_a_second_start_reads_the_cache_and_never_the_bin(tmp_path, monkeypatch):
    _corpus(tmp_path / "c")
    cfg = _config(str(tmp_path / "c"))
    with bin_unreadable(monkeypatch), pytest.raises(AssertionError, match="the .bin was read"):
        check_data(cfg)  # the poison works: without a cache the vocabulary check scans the .bin
    check_data(cfg)  # the launcher's check: scans, builds, writes
    built = build_train_dataset(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.bin", "c.idx", "cache"]  # no folder named like the data
    assert sorted(p.name.split("-", 1)[1] for p in (tmp_path / "cache").rglob("*.*")) == [
        "GPTDataset-description.txt", "GPTDataset-document_index.npy", "GPTDataset-sample_index.npy",
        "GPTDataset-shuffle_index.npy", "IndexedDataset-description.txt", "IndexedDataset-max_token.npy"]
    with bin_unreadable(monkeypatch):
        check_data(cfg)  # a rank's start: the vocabulary check and the indices come from the cache
        assert build_train_dataset(cfg).from_cache
    fresh = build_train_dataset(cfg)
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(fresh, name), getattr(built, name)) and \
            getattr(fresh, name).dtype == getattr(built, name).dtype
    assert all(np.array_equal(fresh[i], built[i]) for i in range(len(built)))


def test_only_the_writing_process_writes(tmp_path):
    _corpus(tmp_path / "c")
    cfg = _config(str(tmp_path / "c"))
    assert not build_train_dataset(cfg).from_cache  # a rank that does not write builds in memory
    assert not (tmp_path / "cache").exists()
    assert not build_train_dataset(cfg, write_cache=True).from_cache
    assert build_train_dataset(cfg).from_cache


def test_a_rewritten_bin_is_scanned_again(tmp_path):
    _corpus(tmp_path / "c")
    check_data(_config(str(tmp_path / "c"), vocab=7009))  # ids up to 7008: cached as the largest
    _corpus(tmp_path / "c", top=7500)  # the same lengths (the same .idx content), a larger id in the .bin
    with pytest.raises(ConfigError, match="token id 7500 is outside --vocab-size 7009"):
        check_data(_config(str(tmp_path / "c"), vocab=7009))


def test_a_changed_index_or_other_flags_miss_the_gpt_cache(tmp_path):
    _corpus(tmp_path / "c")
    check_data(_config(str(tmp_path / "c")))
    assert build_train_dataset(_config(str(tmp_path / "c"))).from_cache
    assert not build_train_dataset(_config(str(tmp_path / "c"), extra=("--seed", "6"))).from_cache
    _corpus(tmp_path / "c", lengths=LENGTHS[::-1])
    rebuilt = build_train_dataset(_config(str(tmp_path / "c")))
    assert not rebuilt.from_cache
    stream = np.concatenate([IndexedDataset(tmp_path / "c")[int(d)] for d in rebuilt.document_index])
    k = int(rebuilt.shuffle_index[0])  # sample 0 is the k-th window of the new corpus's stream, not the old one's
    assert rebuilt[0].tolist() == stream[k * 8:k * 8 + 9].tolist()


def test_a_blend_caches_its_indices_too(tmp_path):
    _corpus(tmp_path / "a")
    _corpus(tmp_path / "b", lengths=[30, 20, 10])
    cfg = _config("0.7", str(tmp_path / "a"), "0.3", str(tmp_path / "b"))
    check_data(cfg)
    assert list((tmp_path / "cache" / "BlendedDataset").glob("*-BlendedDataset-dataset_index.npy"))
    first, second = build_train_dataset(cfg, write_cache=True), build_train_dataset(cfg)
    assert [second[i].tolist() for i in range(len(second))] == [first[i].tolist() for i in range(len(first))]


def test_a_partial_or_damaged_entry_is_a_miss(tmp_path):
    """The description is written last: arrays without it are an entry that was cut short, and a damaged array is
    not read as an index."""
    cache = IndexCache(tmp_path / "cache", "GPTDataset", write=True)
    description, arrays = {"what": "test"}, {"x": np.arange(5)}
    assert cache.save(description, arrays)
    assert np.array_equal(cache.load(description, ("x",))["x"], np.arange(5))
    assert cache.load({"what": "other"}, ("x",)) is None
    (described,) = (tmp_path / "cache").glob("*-description.txt")
    (array,) = (tmp_path / "cache").glob("*-x.npy")
    array.write_bytes(array.read_bytes()[:20])
    assert cache.load(description, ("x",)) is None
    cache.save(description, arrays)
    described.unlink()
    assert cache.load(description, ("x",)) is None
    assert not list((tmp_path / "cache").glob(".*.tmp"))  # no temporary file left behind


def test_data_cache_path_puts_every_entry_there(tmp_path):
    _corpus(tmp_path / "c")
    cfg = _config(str(tmp_path / "c"), extra=("--data-cache-path", str(tmp_path / "elsewhere")))
    assert cfg.train.data_cache_path == str(tmp_path / "elsewhere")
    check_data(cfg)
    assert not (tmp_path / "cache").exists()
    assert len(list((tmp_path / "elsewhere").glob("*-description.txt"))) == 2
    assert build_train_dataset(cfg).from_cache


@contextlib.contextmanager
def unwritable(directory: Path):
    """No new entry can be made in `directory`: chattr +i as root (whom permissions do not stop), else chmod."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode != 0:
            pytest.skip("running as root on a file system without chattr +i: cannot make a directory unwritable")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
    else:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)


def test_an_unwritable_data_directory_still_trains_and_says_so_once(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    _corpus(data / "c", lengths=[300] * 8)  # ids up to 7299: the --vocab-size 8000 below holds them
    monkeypatch.setattr(cache_mod, "_warned", set())
    argv = ["--model", "tiny", "--num-layers", "1", "--vocab-size", "8000", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--train-iters", "2", "--data-path", str(data / "c"), "--split", "100,0,0"]
    with unwritable(data):
        check_data(parse_args(argv, world_size=1))
        with world_of_one():
            result = train_and_collect(parse_args(argv, world_size=1))
    assert len(result["losses"]) == 2 and all(np.isfinite(result["losses"]))
    assert not (data / "cache").exists()
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("data cache:")]
    assert len(said) == 1 and f"cannot write {data / 'cache'}" in said[0], said
