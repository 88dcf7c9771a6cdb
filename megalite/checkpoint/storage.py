"""A pickle-free storage for torch.distributed.checkpoint: safetensors data, a JSON index.

DCP's own FileSystemReader unpickles its `.metadata` file, and its safetensors writer keys
each file by parameter name, so one rank cannot store two pieces of one tensor (a ZeRO
slice crossing rows does exactly that). This storage keeps DCP's planning and resharding
and changes only what lands on disk:

    __<rank>_0.safetensors   each rank's chunks, keyed "<name>@<offsets>"
    tensors.json             written by the coordinator after every rank has written:
                             per tensor its dtype, global size and chunks (offsets,
                             sizes, file, key)

Loading parses JSON and safetensors headers only; a file that is anything else (say a
pickle payload put in its place) is refused with one line and nothing in it is run.
"""

import json
import os
import re

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

INDEX_FILE = "tensors.json"
INDEX_FORMAT = "megalite-dcp-safetensors"
_FILE_RE = re.compile(r"^__\d+_\d+\.safetensors$")  # rank, file number (the converter writes several)
DTYPES = {str(d).replace("torch.", ""): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                     torch.int64, torch.int32, torch.uint8, torch.bool)}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line for the user."""


def checksum(data):
    """The xxh3-64 of bytes as they are written (checkpoint/integrity.py records and checks it)."""
    return xxhash.xxh3_64_hexdigest(data)


def fsync_write(path, data, mode="wb"):
    with open(path, mode) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path, what):
    """Strict JSON from a checkpoint file; anything else is refused in one line."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        return json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        hint = " (it looks like a pickle payload)" if raw[:1] == b"\x80" else ""
        raise CheckpointError(f"{path} is not the JSON {what} megalite writes{hint}; refusing to load it") from None


def _key(fqn, offsets):
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


class SafetensorsWriter(StorageWriter):
    """sums: this rank's files as written, rel -> [bytes, xxh3-64] (checkpoint/integrity.py records them)."""

    def __init__(self, path):
        super().__init__()
        self.path = str(path)
        self.rank = 0
        self.sums = {}

    def reset(self, checkpoint_id=None):
        if checkpoint_id:
            self.path = str(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        import dataclasses
        return [dataclasses.replace(p, storage_data=f"__{i}_0.safetensors") for i, p in enumerate(plans)]

    def write_data(self, plan, planner):
        from safetensors.torch import save
        name, tensors, results = plan.storage_data, {}, []
        for item in plan.items:
            t = planner.resolve_data(item).detach()
            t = t.to("cpu").contiguous()
            key = _key(item.index.fqn, item.index.offset)
            tensors[key] = t
            results.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(),
                                       storage_data={"file": name, "key": key}))
        if tensors:
            data = save(tensors)
            fsync_write(os.path.join(self.path, name), data)
            self.sums[name] = [len(data), checksum(data)]
        fut = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results):
        where = {r.index: r.storage_data for rs in results for r in rs}
        index = {}
        for fqn, md in metadata.state_dict_metadata.items():
            chunks = []
            for c in md.chunks:
                loc = where[MetadataIndex(fqn, c.offsets)]
                chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes), **loc})
            index[fqn] = {"dtype": str(md.properties.dtype).replace("torch.", ""), "size": list(md.size),
                          "chunks": chunks}
        body = json.dumps({"format": INDEX_FORMAT, "version": 1, "tensors": index}, indent=1).encode()
        fsync_write(os.path.join(self.path, INDEX_FILE), body)
        self.sums[INDEX_FILE] = [len(body), checksum(body)]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return True


def read_index(path):
    """{name: {"dtype", "size", "chunks"}} of a checkpoint directory, validated."""
    doc = read_json(os.path.join(path, INDEX_FILE), "tensor index")
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT or not isinstance(doc.get("tensors"), dict):
        raise CheckpointError(f"{os.path.join(path, INDEX_FILE)} is not a megalite tensor index")
    for name, e in doc["tensors"].items():
        ok = (isinstance(e, dict) and e.get("dtype") in DTYPES and isinstance(e.get("size"), list)
              and isinstance(e.get("chunks"), list)
              and all(isinstance(c, dict) and _FILE_RE.match(str(c.get("file", ""))) and isinstance(c.get("key"), str)
                      and len(c.get("offsets", ())) == len(e["size"]) == len(c.get("sizes", ()))
                      for c in e["chunks"]))
        if not ok:
            raise CheckpointError(f"{os.path.join(path, INDEX_FILE)}: malformed entry for tensor {name!r}")
    return doc["tensors"]


def _safetensors_size(path, head):
    """The bytes a safetensors file's header says it holds (header and data), or None where it does not parse."""
    n = int.from_bytes(head[:8], "little")
    try:
        with open(path, "rb") as f:
            f.seek(8)
            header = json.loads(f.read(n))
        return 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return 8 + n if os.path.getsize(path) < 8 + n else None  # (a header cut short: truncated)


def open_safetensors(path):
    """safe_open, with a foreign file (e.g. a pickle) refused in one line, and a truncated one called so."""
    from safetensors import safe_open
    try:
        with open(path, "rb") as f:
            head = f.read(9)
        if len(head) < 9 or head[8:9] != b"{":
            raise ValueError("no safetensors header")
        size, want = os.path.getsize(path), _safetensors_size(path, head)
        if want is not None and size < want:
            raise CheckpointError(f"{path} is truncated: {size} of the {want} bytes its header describes; "
                                  "refusing to load it")
        return safe_open(path, framework="pt")
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
    except Exception as e:  # noqa: BLE001 - any parse failure means "not ours"
        hint = " (it looks like a pickle payload)" if head[:1] == b"\x80" else ""
        raise CheckpointError(f"{path} is not a safetensors file{hint}; refusing to load it ({e})") from None


def validate_files(path):
    """The index and every data file it names parse (JSON; safetensors headers)."""
    for file in sorted({c["file"] for e in read_index(path).values() for c in e["chunks"]}):
        with open_safetensors(os.path.join(path, file)):
            pass


class SafetensorsReader(StorageReader):
    def __init__(self, path):
        super().__init__()
        self.path = str(path)
        self.storage_data = {}

    def reset(self, checkpoint_id=None):
        self.storage_data = {}
        if checkpoint_id:
            self.path = str(checkpoint_id)

    def read_metadata(self, *args, **kwargs):
        sd_md, storage = {}, {}
        for fqn, e in read_index(self.path).items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
                      for c in e["chunks"]]
            sd_md[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=DTYPES[e["dtype"]]),
                                               size=torch.Size(e["size"]), chunks=chunks)
            for c in e["chunks"]:
                storage[MetadataIndex(fqn, c["offsets"])] = (c["file"], c["key"])
        return Metadata(state_dict_metadata=sd_md, storage_data=storage)

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        per_file = {}
        for item in plan.items:
            file, key = self.storage_data[item.storage_index]
            per_file.setdefault(file, []).append((item, key))
        for file, reqs in per_file.items():
            with open_safetensors(os.path.join(self.path, file)) as f:
                for req, key in reqs:
                    sl = tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))
                    src = f.get_slice(key)[sl]
                    dst = planner.resolve_tensor(req).detach()
                    if dst.shape != src.shape:
                        raise CheckpointError(f"{file}: chunk {key} has shape {tuple(src.shape)}, "
                                              f"expected {tuple(dst.shape)}")
                    dst.copy_(src)
                    planner.commit_tensor(req, dst)
        fut = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return True
