"""Megatron's indexed dataset (.bin/.idx): our writer and reader against the format's definition, and against
Megatron's own IndexedDatasetBuilder / IndexedDataset (the megatron-core package of the test extra, or a .mlm copy of
Megatron-LM; tests/support/megatron.py).

The corpora are synthetic: they test the format's plumbing, not any measurement."""
import struct
from pathlib import Path

import numpy as np
import pytest

from common.errors import InputError
from engine.datasets.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetWriter,
    optimal_dtype,
)
from tests.support.megatron import megatron_datasets

DOCS = [[5, 6, 7], [], [65000, 1], [42] * 9]


def _write(prefix, docs=DOCS, dtype=np.uint16):
    writer = IndexedDatasetWriter(prefix, dtype)
    for doc in docs:
        writer.add_document(doc)
    writer.finalize()
    return prefix


def test_round_trip_reads_back_every_document(tmp_path):
    dataset = IndexedDataset(_write(tmp_path / "c"))
    assert len(dataset) == dataset.num_documents == len(DOCS)
    assert [dataset[i].tolist() for i in range(len(DOCS))] == DOCS
    assert dataset.get(3, offset=2, length=3).tolist() == [42] * 3
    assert dataset.get(2, offset=1).tolist() == [1]
    assert dataset.max_token() == 65000


def test_index_bytes_follow_the_format_definition(tmp_path):
    """Header: magic, u64 version 1, u8 dtype code (uint16 is 8, int32 is 4), u64 sequences, u64 document indices;
    then i32 lengths, i64 byte pointers (running sum of lengths x itemsize), i64 document indices from 0."""
    for dtype, code, itemsize in ((np.uint16, 8, 2), (np.int32, 4, 4)):
        prefix = _write(tmp_path / f"c{code}", dtype=dtype)
        raw = Path(f"{prefix}.idx").read_bytes()
        n = len(DOCS)
        assert raw[:9] == b"MMIDIDX\x00\x00"
        assert struct.unpack("<QBQQ", raw[9:34]) == (1, code, n, n + 1)
        lengths = struct.unpack(f"<{n}i", raw[34:34 + 4 * n])
        pointers = struct.unpack(f"<{n}q", raw[34 + 4 * n:34 + 12 * n])
        documents = struct.unpack(f"<{n + 1}q", raw[34 + 12 * n:])
        assert lengths == (3, 0, 2, 9)
        assert pointers == (0, 3 * itemsize, 3 * itemsize, 5 * itemsize)
        assert documents == (0, 1, 2, 3, 4)
        assert Path(f"{prefix}.bin").read_bytes() == np.concatenate([np.array(d, dtype) for d in DOCS]).tobytes()


def test_megatrons_dtype_choice():
    assert optimal_dtype(65499) == np.uint16 and optimal_dtype(65500) == np.int32


def test_writer_refuses_ids_its_dtype_cannot_hold(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "c", np.uint16)
    with pytest.raises(InputError, match="do not fit uint16"):
        writer.add_document([70000])
    writer.discard()
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def megatron_indexed_dataset(tmp_path_factory):
    with megatron_datasets(tmp_path_factory.mktemp("mlm")):
        from megatron.core.datasets import indexed_dataset
        yield indexed_dataset


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # in Megatron's builder
def test_reads_what_megatrons_builder_writes(tmp_path, megatron_indexed_dataset, dtype):
    """Megatron's IndexedDatasetBuilder, including a document of several sequences (add_item + end_document), so
    that the document indices are not simply 0..n."""
    import torch

    prefix = str(tmp_path / "mlm")
    builder = megatron_indexed_dataset.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    builder.add_document(torch.tensor([1, 2, 3]), [3])
    builder.add_item(torch.tensor([4, 5]))
    builder.add_item(torch.tensor([6]))
    builder.end_document()
    builder.add_document(torch.tensor([60000, 7, 8, 9]), [4])
    builder.finalize(f"{prefix}.idx")
    ours = IndexedDataset(prefix)
    assert ours.dtype == dtype
    assert [ours[i].tolist() for i in range(len(ours))] == [[1, 2, 3], [4, 5], [6], [60000, 7, 8, 9]]
    assert ours.document_indices.tolist() == [0, 1, 3, 4] and ours.num_documents == 3
    assert ours.get(3, offset=1, length=2).tolist() == [7, 8]


def test_megatrons_reader_reads_what_we_write(tmp_path, megatron_indexed_dataset):
    prefix = str(_write(tmp_path / "ours"))
    theirs = megatron_indexed_dataset.IndexedDataset(prefix)
    assert len(theirs) == len(DOCS)
    assert [theirs[i].tolist() for i in range(len(DOCS))] == DOCS
    assert theirs.document_indices.tolist() == list(range(len(DOCS) + 1))


def _damaged(tmp_path, damage) -> str:
    prefix = _write(tmp_path / "c")
    damage(Path(f"{prefix}.idx"), Path(f"{prefix}.bin"))
    return str(prefix)


@pytest.mark.parametrize("damage, file, message", [
    (lambda idx, bin_: idx.unlink(), ".idx", "no such index file"),
    (lambda idx, bin_: bin_.unlink(), ".bin", "no such data file"),
    (lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:-2]), ".bin", "truncated"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:-8]), ".idx", "truncated or not a Megatron index"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:20]), ".idx", "shorter than the index header"),
    (lambda idx, bin_: idx.write_bytes(b"NOTANIDX\x00" + idx.read_bytes()[9:]), ".idx", "bad magic"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:17] + b"\x63" + idx.read_bytes()[18:]), ".idx",
     "unknown dtype code 99"),
    (lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:34] + struct.pack("<i", 4) + idx.read_bytes()[38:]),
     ".idx", "pointers disagree"),
])
def test_damaged_files_are_input_errors_naming_the_file(tmp_path, damage, file, message):
    prefix = _damaged(tmp_path, damage)
    with pytest.raises(InputError, match=message) as caught:
        IndexedDataset(prefix)
    assert str(caught.value.path).endswith(file)
