"""Megatron-LM's memory-mapped indexed dataset (`.bin` tokens + `.idx` index), byte for byte.

`.idx` layout (little endian):
    9 bytes  magic  b"MMIDIDX\\x00\\x00"
    uint64   version (1)
    uint8    dtype code (Megatron's DType enum: uint8=1 int8=2 int16=3 int32=4 int64=5
             float64=6 float32=7 uint16=8)
    uint64   sequence count  S
    uint64   document count  D (length of the document index array, i.e. documents + 1)
    int32[S] sequence lengths (tokens)
    int64[S] sequence byte pointers into `.bin`
    int64[D] document indices: sequence index where each document starts, then S
`.bin` is the tokens of every sequence back to back in the dtype above.
"""

from __future__ import annotations

import os
import struct

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8

DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int | None):
    """Megatron's rule: uint16 when every token id fits (cardinality < 65500), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def write_index(idx_path: str, dtype, sequence_lengths, document_indices) -> None:
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    if lengths.size and lengths.max() > np.iinfo(np.int32).max:
        raise ValueError(f"{idx_path}: a sequence of {lengths.max()} tokens does not fit int32")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    with open(idx_path, "wb") as f:
        f.write(INDEX_MAGIC)
        f.write(struct.pack("<Q", INDEX_VERSION))
        f.write(struct.pack("<B", CODE_OF_DTYPE[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(docs.astype("<i8").tobytes())


class IndexedDatasetBuilder:
    """Appends token sequences to `.bin`; `finalize` writes the matching `.idx`."""

    def __init__(self, bin_path: str, dtype=np.int32):
        if np.dtype(dtype) not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {dtype} has no Megatron dtype code")
        self.dtype = np.dtype(dtype)
        self._bin = open(bin_path, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes())
        self.sequence_lengths.append(arr.size)

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths) -> None:
        """Append a whole document: `tokens` flat, `lengths` its sequences (sentences)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes())
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.end_document()

    def add_arrays(self, tokens: np.ndarray, seq_lengths, docs_end_after) -> None:
        """Bulk append: flat `tokens`, per-sequence lengths, and for each new document the
        number of its sequences (vectorised path used by the preprocessor)."""
        self._bin.write(np.asarray(tokens, dtype=self.dtype).tobytes())
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(np.asarray(seq_lengths, dtype=np.int64).tolist())
        ends = base + np.cumsum(np.asarray(docs_end_after, dtype=np.int64))
        self.document_indices.extend(ends.tolist())

    def add_index(self, prefix: str) -> None:
        """Append another dataset (same dtype), e.g. one written by a worker."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{prefix}: dtype {other.dtype} differs from builder dtype {self.dtype}")
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((other.document_indices[1:] + base).tolist())
        with open(data_file_path(prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)

    def finalize(self, idx_path: str) -> None:
        self._bin.close()
        write_index(idx_path, self.dtype, self.sequence_lengths, self.document_indices)


def _fail(path: str, what: str):
    raise ValueError(f"{path}: {what}; re-run tools/preprocess_data.py to rebuild it")


class IndexedDataset:
    """Read-only, memory-mapped view of `{prefix}.bin/.idx`, validated on open so that a
    truncated or foreign file is one clear error naming it rather than garbage samples."""

    def __init__(self, path_prefix: str):
        self.path_prefix = path_prefix
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{p}: file not found (expected a Megatron dataset "
                                        f"prefix without .bin/.idx; got {path_prefix!r})")
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(HEADER_SIZE)
        if len(head) < 9 or head[:9] != INDEX_MAGIC:
            _fail(idx_path, f"not a Megatron mmap index (magic {head[:9]!r}, expected {INDEX_MAGIC!r})")
        if len(head) < HEADER_SIZE:
            _fail(idx_path, f"truncated header ({idx_size} bytes)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
        if version != INDEX_VERSION:
            _fail(idx_path, f"unsupported index version {version} (expected 1)")
        if code not in DTYPE_CODES:
            _fail(idx_path, f"unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_SIZE + 12 * n_seq + 8 * n_doc
        if idx_size != expected:
            _fail(idx_path, f"size {idx_size} bytes does not match its header "
                            f"({n_seq} sequences, {n_doc} document entries need {expected})")
        idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(idx, "<i4", n_seq, HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(idx, "<i8", n_seq, HEADER_SIZE + 4 * n_seq)
        self.document_indices = np.frombuffer(idx, "<i8", n_doc, HEADER_SIZE + 12 * n_seq)
        self._validate_index(idx_path, n_seq)

        n_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        need = n_tokens * self.dtype.itemsize
        bin_size = os.path.getsize(bin_path)
        if bin_size != need:
            _fail(bin_path, f"size {bin_size} bytes but its index says {n_tokens} tokens of "
                            f"{self.dtype} ({need} bytes): truncated or not the pair of {idx_path}")
        self.num_tokens = n_tokens
        # np.memmap cannot map an empty file; an empty dataset simply has no tokens.
        self._bin = (np.memmap(bin_path, mode="r", dtype=self.dtype) if need
                     else np.zeros(0, dtype=self.dtype))

    def __getstate__(self):  # pickled for DataLoader workers: reopen the files, copy nothing
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state):
        self.__init__(state["path_prefix"])

    def _validate_index(self, idx_path: str, n_seq: int) -> None:
        lengths, ptrs, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        if n_seq and lengths.min() < 0:
            _fail(idx_path, "negative sequence length")
        expect = np.zeros(n_seq, dtype=np.int64)
        if n_seq > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=expect[1:])
        if not np.array_equal(expect, ptrs):
            _fail(idx_path, "sequence pointers are inconsistent with sequence lengths")
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != n_seq or np.any(np.diff(docs) < 0):
            _fail(idx_path, "document indices must rise from 0 to the sequence count")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `idx` (a view into the mmap)."""
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        n = int(self.sequence_lengths[idx]) - offset if length is None else length
        return self._bin[start:start + n]

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def tokens(self) -> np.ndarray:
        """All tokens, back to back (the `.bin` as an array)."""
        return self._bin
