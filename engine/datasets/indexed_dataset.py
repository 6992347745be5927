"""Megatron-LM's indexed dataset: a `.bin` of token ids and a `.idx` that says where each sequence lies.

The format (Megatron Core's indexed_dataset.py, as written by tools/preprocess_data.py), all little-endian:

    .idx  b"MMIDIDX\\x00\\x00"  magic (9 bytes)
          u64 version = 1
          u8  dtype code of the tokens (DTYPE_CODES)
          u64 S, the number of sequences
          u64 D, the number of document indices (documents + 1)
          i32[S] sequence lengths, in tokens
          i64[S] sequence pointers, byte offsets into the .bin
          i64[D] document indices: document k is sequences [doc[k], doc[k+1]); doc[0] = 0
          (i8[S] sequence modes, multimodal datasets only: not read here)
    .bin  the tokens of every sequence, back to back, in that dtype

Everything is read through memory maps, so opening a corpus costs its index, not its tokens. A file that does not
match the format is an InputError naming it: the CLI turns that into one line and exit status 2.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from common.errors import InputError
from engine.datasets.cache import IndexCache, file_identity

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type[np.number]] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                           6: np.float64, 7: np.float32, 8: np.uint16}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document index count


def optimal_dtype(vocab_size: int) -> type[np.number]:
    """Megatron's choice: 2-byte tokens while the vocabulary fits (below 65500), 4-byte beyond."""
    return np.uint16 if vocab_size < 65500 else np.int32


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


class IndexedDataset:
    """The sequences of one `.bin`/`.idx` pair. dataset[i] is sequence i; get(i, offset, length) a part of it."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        index = idx_path(prefix)
        if not index.is_file():
            raise InputError(index, "no such index file (a Megatron dataset is PREFIX.idx + PREFIX.bin)")
        self._index = np.memmap(index, dtype=np.uint8, mode="r") if index.stat().st_size else np.zeros(0, np.uint8)
        count, doc_count, self.dtype = self._read_header(index)
        lengths_at = _HEADER.size
        pointers_at = lengths_at + 4 * count
        documents_at = pointers_at + 8 * count
        end = documents_at + 8 * doc_count
        if self._index.size not in (end, end + count):  # + count: the multimodal modes
            raise InputError(index, f"is {self._index.size} bytes; its header ({count} sequences, {doc_count} "
                                    f"document indices) needs {end}: truncated or not a Megatron index")
        self.sequence_lengths = np.frombuffer(self._index, np.int32, count, lengths_at)
        self.sequence_pointers = np.frombuffer(self._index, np.int64, count, pointers_at)
        self.document_indices = np.frombuffer(self._index, np.int64, doc_count, documents_at)
        self._check_index(index)
        self._bin = self._map_bin()

    def _read_header(self, index: Path) -> tuple[int, int, type[np.number]]:
        if self._index.size < _HEADER.size:
            raise InputError(index, f"is {self._index.size} bytes, shorter than the index header")
        magic, version, code, count, doc_count = _HEADER.unpack(self._index[:_HEADER.size].tobytes())
        if magic != MAGIC:
            raise InputError(index, f"bad magic {magic!r}: not a Megatron indexed dataset index")
        if version != VERSION:
            raise InputError(index, f"index version {version}; only version {VERSION} is known")
        if code not in DTYPE_CODES:
            raise InputError(index, f"unknown dtype code {code}")
        return count, doc_count, DTYPE_CODES[code]

    def _check_index(self, index: Path) -> None:
        """The pointers must be the running sum of the lengths and the documents must cover the sequences in order:
        anything else is a corrupt index, whose samples would silently read the wrong tokens."""
        lengths, docs = self.sequence_lengths.astype(np.int64), self.document_indices
        itemsize = np.dtype(self.dtype).itemsize
        expected = np.concatenate(([0], np.cumsum(lengths[:-1]) * itemsize)) if lengths.size else lengths
        if (lengths < 0).any() or not np.array_equal(self.sequence_pointers, expected):
            raise InputError(index, "sequence pointers disagree with the sequence lengths: corrupt index")
        if docs.size == 0 or docs[0] != 0 or docs[-1] != lengths.size or (np.diff(docs) < 0).any():
            raise InputError(index, "document indices do not cover the sequences in order: corrupt index")

    def _map_bin(self) -> np.ndarray:
        data = bin_path(self.prefix)
        if not data.is_file():
            raise InputError(data, "no such data file (a Megatron dataset is PREFIX.idx + PREFIX.bin)")
        needed = int(self.sequence_lengths.astype(np.int64).sum()) * np.dtype(self.dtype).itemsize
        size = data.stat().st_size
        if size < needed:
            raise InputError(data, f"is {size} bytes; its index needs {needed}: truncated")
        if needed == 0:
            return np.zeros(0, self.dtype)
        return np.memmap(data, dtype=self.dtype, mode="r", shape=(needed // np.dtype(self.dtype).itemsize,))

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.size - 1)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `index` (to its end when length is None), a view of the map."""
        start = int(self.sequence_pointers[index]) // np.dtype(self.dtype).itemsize + offset
        stop = start - offset + int(self.sequence_lengths[index]) if length is None else start + length
        return self._bin[start:stop]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def max_token(self, cache: IndexCache | None = None) -> int:
        """The largest token id in the .bin, -1 when empty. Checked against --vocab-size before training: an id past
        the embedding would fail mid-run. The scan reads the whole .bin (in chunks, so a large corpus is never loaded
        whole); with a cache it runs once per version of the files: the entry is keyed by the .bin's and the .idx's
        identity (engine.datasets.cache.file_identity), so a rewritten .bin is scanned again."""
        description = {"class": "IndexedDataset", "what": "max_token",
                       "bin": file_identity(bin_path(self.prefix)), "idx": file_identity(idx_path(self.prefix))}
        cached = cache.load(description, ("max_token",)) if cache is not None else None
        if cached is not None:
            return int(cached["max_token"][0])
        chunk = 1 << 24
        largest = max((int(self._bin[i:i + chunk].max()) for i in range(0, self._bin.size, chunk)), default=-1)
        if cache is not None:
            cache.save(description, {"max_token": np.array([largest], dtype=np.int64)})
        return largest


class IndexedDatasetWriter:
    """Writes a `.bin`/`.idx` pair, one document (of one sequence) at a time. The .bin and .idx are written to
    temporary names and renamed when finished, the .idx last: a prefix whose .idx exists is complete."""

    def __init__(self, prefix: str | os.PathLike, dtype: type[np.number]):
        self.prefix, self.dtype = os.fspath(prefix), dtype
        self._bin_tmp = Path(f"{bin_path(prefix)}.tmp")
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed in finalize
        self.lengths: list[int] = []

    def add_document(self, tokens) -> None:
        array = np.asarray(tokens)
        converted = array.astype(self.dtype)
        if array.size and not np.array_equal(converted, array):
            raise InputError(self.prefix, f"token ids {array.min()}..{array.max()} do not fit {np.dtype(self.dtype)}")
        self._bin.write(converted.tobytes(order="C"))
        self.lengths.append(int(converted.size))

    def discard(self) -> None:
        """Give up: nothing of this prefix is left behind (a failed preprocess leaves no half dataset)."""
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)

    def finalize(self) -> None:
        self._bin.close()
        count = len(self.lengths)
        lengths = np.asarray(self.lengths, dtype=np.int32)
        pointers = np.concatenate(([0], np.cumsum(lengths[:-1], dtype=np.int64))) * np.dtype(self.dtype).itemsize
        documents = np.arange(count + 1, dtype=np.int64)
        code = next(c for c, t in DTYPE_CODES.items() if t == self.dtype)
        os.replace(self._bin_tmp, bin_path(self.prefix))
        index_tmp = Path(f"{idx_path(self.prefix)}.tmp")
        with open(index_tmp, "wb") as out:
            out.write(_HEADER.pack(MAGIC, VERSION, code, count, count + 1))
            out.write(lengths.tobytes())
            out.write(pointers.astype(np.int64).tobytes())
            out.write(documents.tobytes())
        os.replace(index_tmp, idx_path(self.prefix))
