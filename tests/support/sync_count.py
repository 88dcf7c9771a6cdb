"""Count the calls that make the host wait for the device (on a GPU) during a block of code.

The CPU suite has no device to wait for, so it counts the operations that read a tensor's
values on the host, which on a GPU are exactly the synchronising ones: .item(), .tolist(),
bool()/float()/int() of a tensor (an `if t:` or math.isfinite(t)), .cpu()/.numpy(), and
value-dependent shapes (nonzero, masked_select, unique, equal). A TorchFunctionMode sees
every such call, including those made inside megalite and torch.nn code. Not counted: reads
made by torch.optim itself (its step counters live on the host on a GPU too).
"""
import traceback

import torch
from torch.overrides import TorchFunctionMode

SYNCING = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "nonzero",
           "masked_select", "unique", "equal", "allclose", "__format__", "__repr__"}


class SyncCounter(TorchFunctionMode):
    """with SyncCounter() as sc: ...; sc.count, sc.calls (name, where) for the report."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        stack = traceback.extract_stack()[:-1] if name in SYNCING else None
        if stack and "torch/optim/" not in stack[-1].filename:
            frame = next((f for f in reversed(stack)
                          if "megalite" in f.filename or "/tests/" in f.filename or "pretrain" in f.filename), None)
            self.calls.append((name, f"{frame.filename.split('/')[-1]}:{frame.lineno}" if frame else "?"))
        return func(*args, **(kwargs or {}))

    @property
    def count(self):
        return len(self.calls)
