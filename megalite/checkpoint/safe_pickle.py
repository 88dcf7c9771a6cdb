"""Reading the pickles of another framework's checkpoint without running its code.

Megatron-LM's `torch_dist` directories hold three kinds of pickle: PyTorch DCP's `.metadata` (the index),
`common.pt` (a torch.save of the iteration, Megatron's argparse namespace, the LR schedule) and the byte items
inside the `.distcp` files (also torch.saves). A pickle names the functions it calls, so a hostile directory
could run anything on `torch.load` / `pickle.load`. `loads` / `torch_load` admit only what those files hold
— DCP's metadata classes, plain containers, tensors and their storages, numpy arrays, argparse's namespace, torch's
dtypes —
and stand Megatron's own classes (enums, config objects) in as inert records; anything else is refused in one
line naming the global and the file. megalite's own checkpoints hold no pickle at all."""

import io
import pickle

import torch

from megalite.checkpoint.storage import CheckpointError

_DCP = "torch.distributed.checkpoint."
ALLOWED = {
    ("builtins", n) for n in ("set", "frozenset", "slice", "complex", "bytearray", "range")
} | {
    ("collections", "OrderedDict"), ("argparse", "Namespace"), ("types", "SimpleNamespace"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"), ("torch", "device"), ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    # numpy arrays (Megatron's RNG item holds numpy's generator state): an empty array of a dtype, then its bytes;
    # an object array's elements are pickles of their own, refused here like any other
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "_reconstruct"),
} | {(_DCP + "metadata", n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                     "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                                     "_MEM_FORMAT_ENCODING")} | {
    (_DCP + "filesystem", "_StorageInfo")} | {
    (_DCP + "planner", n) for n in ("SavePlan", "TensorWriteData", "WriteItem", "WriteItemType")}


class Foreign:
    """A Megatron object in a pickle (an enum member, a config): its name and what built it, nothing run."""

    def __init__(self, name, *args, **kwargs):
        self.name, self.args, self.kwargs, self.state = name, args, kwargs, None

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"{self.name}{self.args!r}"

    def __eq__(self, other):
        return isinstance(other, Foreign) and (self.name, self.args) == (other.name, other.args)

    __hash__ = None


def _latin1(text, encoding="utf-8"):
    """codecs.encode as protocol 2 pickles bytes (latin-1 text), refusing any other codec."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise CheckpointError(f"a pickle asks codecs.encode for {encoding!r}; refused (only latin-1 bytes)")
    return text.encode("latin1")


def _foreign(name):
    def build(*args, **kwargs):
        return Foreign(name, *args, **kwargs)
    build.__new__ = None  # (pickle's NEWOBJ calls cls.__new__: not allowed on a stand-in)
    return build


class _Unpickler(pickle.Unpickler):
    source = "a pickle"

    def find_class(self, module, name):
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if (module, name) == ("_codecs", "encode"):
            return _latin1  # (protocol 2's bytes: a numpy array's data)
        if module == "torch" and (isinstance(getattr(torch, name, None), torch.dtype) or name.endswith("Storage")):
            return getattr(torch, name)  # dtypes (torch.float32), typed storages of a tensor's data
        if module.split(".")[0] == "megatron":
            return _foreign(f"{module}.{name}")
        raise CheckpointError(f"{self.source} wants to load {module}.{name}, which a checkpoint does not need; "
                              "refused (a checkpoint's pickle may name only data classes)")


def loads(data, source):
    """pickle.loads of `data` (bytes or a file object), restricted as above."""
    f = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    u = _Unpickler(f)
    u.source = source
    try:
        return u.load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: one line
        raise CheckpointError(f"{source} is not a readable pickle ({type(e).__name__}: {str(e)[:120]})") from None


def torch_load(data, source):
    """torch.load of a torch.save (a zip), its pickle restricted as above; tensors to the CPU."""
    class _Module:
        class Unpickler(_Unpickler):
            pass
        load = staticmethod(pickle.load)
        __name__ = "megalite_safe_pickle"
    _Module.Unpickler.source = source
    f = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        return torch.load(f, map_location="cpu", weights_only=False, pickle_module=_Module)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{source} is not a readable torch.save file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None

