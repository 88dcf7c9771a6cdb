"""Run any torchrun entry script under measurement, the same way for megalite and for its peers:

    python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/peers_meter.py \
        --out DIR [--bytes] [--saved] -- SCRIPT.py ARGS...

SCRIPT runs in this process (runpy, run_name "__main__", sys.argv = [SCRIPT] + ARGS). When it ends, also by
SystemExit, an exception or torchrun's SIGTERM, DIR/rank{RANK}.json gets peak_rss_bytes (VmHWM), on a GPU
peak_cuda_bytes (torch.cuda.max_memory_allocated) and, when asked:
- --bytes: what this rank sent, by collective and in total, seen by a TorchDispatchMode on every
  torch.ops.c10d.* / _c10d_functional(_autograd).* op (torch.distributed calls, DTensor's functional
  collectives, FSDP2's and pipelining's, autograd backward included), in the ring "wire" bytes of
  megalite/distributed/comm.py: all-reduce 2(d-1)/d x payload, reduce-scatter (d-1)/d x input, all-gather
  (d-1)/d x output, all-to-all (d-1)/d x input, send its tensor, recv 0, broadcast the payload on the source
  (d: the size of the op's process group). Every op then goes through Python and DTensor off its C++ fast
  path: step times under --bytes are not comparable;
- --saved: the peak of live activation bytes saved for backward (saved_tensors_hooks; each storage counted
  once while any saved reference to it is alive). Weights are left out (a saved nn.Parameter or a view of
  one): they are state, and ZeRO-3 / FSDP2 free a gathered weight's storage while autograd still
  references it, so its address is reused and a count by address would be wrong either way.
The process then ends with os._exit(status), after Python's exit handlers, skipping interpreter teardown.
"""

import argparse
import atexit
import collections
import contextlib
import gc
import json
import os
import runpy
import signal
import sys
import threading
import traceback

import torch
from torch.utils._python_dispatch import (TorchDispatchMode, is_traceable_wrapper_subclass,
                                          is_traceable_wrapper_subclass_type)

NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
NOT_COMMUNICATION = {"wait_tensor", "_wrap_tensor_autograd", "check_for_nan"}
# op -> (kind, argument holding the counted tensors); c10d ops first, then the functional ones
_RING = {"allreduce_": ("all_reduce", "tensors"), "allreduce_coalesced_": ("all_reduce", "tensors"),
         "_allgather_base_": ("all_gather", "output_tensor"), "allgather_": ("all_gather", "output_tensors"),
         "allgather_coalesced_": ("all_gather", "output_lists"),
         "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
         "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
         "reduce_scatter_": ("reduce_scatter", "input_tensors"),
         "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
         "alltoall_base_": ("all_to_all", "input"), "alltoall_": ("all_to_all", "input_tensors"),
         "reduce_": ("reduce", "tensors"),  # not in comm.py: counted as its reduce-scatter half, (d-1)/d
         "all_reduce": ("all_reduce", "input"), "all_reduce_": ("all_reduce", "input"),
         "all_reduce_coalesced": ("all_reduce", "inputs"), "all_reduce_coalesced_": ("all_reduce", "inputs"),
         "all_gather_into_tensor": ("all_gather", "input"), "all_gather_into_tensor_out": ("all_gather", "input"),
         "all_gather_into_tensor_coalesced": ("all_gather", "inputs"),  # inputs: scaled by group_size
         "reduce_scatter_tensor": ("reduce_scatter", "input"), "reduce_scatter_tensor_out": ("reduce_scatter", "input"),
         "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
         "all_to_all_single": ("all_to_all", "input")}


def nbytes(x):
    """Bytes of a tensor or of a (nested) list of tensors."""
    if isinstance(x, (list, tuple)):
        return sum(nbytes(y) for y in x)
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def process_group(group):
    """The ProcessGroup behind an op's argument: a boxed ProcessGroup (c10d) or a group name (functional)."""
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(group)
    return torch.distributed.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else group


class ByteMeter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.defaultdict(lambda: [0, 0, 0.0])  # kind -> calls, payload, wire
        self.by_torch_op = collections.defaultdict(lambda: [0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A wrapper subclass (DTensor) runs its own dispatch, which issues the collectives of implicit
        # redistributions; handing the op back to it keeps this mode on the stack while it does so.
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        if func.namespace in NAMESPACES:
            self.record(func, args, kwargs)
        return func(*args, **kwargs)

    def add(self, kind, torch_op, payload, wire):
        c = self.counts[kind]
        c[0], c[1], c[2] = c[0] + 1, c[1] + payload, c[2] + wire
        self.by_torch_op[torch_op][0] += 1
        self.by_torch_op[torch_op][1] += wire

    def record(self, func, args, kwargs):
        name = func._schema.name.split("::")[1]
        if name in NOT_COMMUNICATION:
            return
        a = dict(zip((x.name for x in func._schema.arguments), args), **kwargs)
        pg = process_group(a.get("process_group", a.get("group_name")))
        d, me, op = pg.size(), pg.rank(), f"{func.namespace}.{name}"
        tensors = a.get("tensors", a.get("tensor", a.get("input")))
        if name in _RING:
            kind, arg = _RING[name]
            payload = nbytes(a[arg]) * (a["group_size"] if name.startswith("all_gather_into") else 1)
            self.add(kind, op, payload, (2 if kind == "all_reduce" else 1) * (d - 1) / d * payload)
        elif name in ("send", "isend"):
            self.add("send", op, nbytes(tensors), nbytes(tensors))
        elif name in ("recv_", "recv_any_source_", "irecv"):
            self.add("recv", op, nbytes(tensors), 0)
        elif name == "batch_p2p_ops":
            for kind, t in zip(a["op_list"], a["tensors"]):
                self.add("send" if "send" in kind else "recv", op, nbytes(t), nbytes(t) * ("send" in kind))
        elif name in ("broadcast_", "broadcast"):
            self.add("broadcast", op, nbytes(tensors), nbytes(tensors) * (me == a.get("root_rank", a.get("src"))))
        else:  # barriers, and ops not counted (gather_, scatter_, ...): listed with no bytes, never unseen
            self.add(name if "barrier" in name else "unknown:" + name, op, 0, 0)

    def report(self):
        return {"total_wire_bytes": sum(c[2] for c in self.counts.values()),
                "by_op": {k: {"calls": c, "payload_bytes": p, "wire_bytes": w}
                          for k, (c, p, w) in sorted(self.counts.items())},
                "by_torch_op": {k: {"calls": c, "wire_bytes": w} for k, (c, w) in sorted(self.by_torch_op.items())}}


def storages(t):
    """(key, bytes) of the storages behind a tensor; a wrapper subclass (DTensor) by its inner tensors."""
    if is_traceable_wrapper_subclass(t):
        inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
        return [s for x in inner if isinstance(x, torch.Tensor) for s in storages(x)]
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # storage-less tensors
        return []
    return [((t.device.type, t.device.index, s.data_ptr()), s.nbytes())] if s.data_ptr() and s.nbytes() else []


class SavedMeter:
    """Peak of live saved-for-backward bytes, each storage counted once while any saved reference lives."""

    class Saved(collections.namedtuple("Saved", "tensor keys meter")):
        def __del__(self):  # autograd dropped this saved reference
            self.meter.release(self.keys)

    def __init__(self):
        self.refs, self.size, self.live, self.peak, self.packs = collections.Counter(), {}, 0, 0, 0

    def pack(self, t):
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter):  # a weight (or a view of one): not an activation
            return t
        keys = storages(t)
        self.packs += 1
        for key, n in keys:
            self.refs[key] += 1
            if self.refs[key] == 1:
                self.size[key] = n
                self.live += n
        self.peak = max(self.peak, self.live)
        return SavedMeter.Saved(t, keys, self)

    unpack = staticmethod(lambda saved: saved.tensor if isinstance(saved, SavedMeter.Saved) else saved)

    def release(self, keys):
        for key, _ in keys:
            self.refs[key] -= 1
            if self.refs[key] == 0:
                del self.refs[key]
                self.live -= self.size.pop(key)

    def report(self):
        return {"peak_saved_bytes": self.peak, "saved_references": self.packs, "live_at_exit_bytes": self.live}


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main():
    cut = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                usage="peers_meter.py --out DIR [--bytes] [--saved] -- SCRIPT.py ARGS...")
    p.add_argument("--out", required=True)
    p.add_argument("--bytes", action="store_true", help="count the bytes each collective sends")
    p.add_argument("--saved", action="store_true", help="peak of live bytes saved for backward")
    a, script_argv = p.parse_args(sys.argv[1:cut]), sys.argv[cut + 1:]
    if not script_argv:
        p.error("no SCRIPT after --")
    os.makedirs(a.out, exist_ok=True)
    sys.argv = list(script_argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script_argv[0])))  # as `python SCRIPT.py` would
    bytes_meter, saved_meter = ByteMeter() if a.bytes else None, SavedMeter() if a.saved else None
    result, code = {"script": script_argv[0], "argv": script_argv[1:]}, 0
    # torchrun SIGTERMs the other ranks as soon as one exits non-zero: still write this rank's file
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with contextlib.ExitStack() as stack:
            if saved_meter:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(saved_meter.pack, saved_meter.unpack))
            if bytes_meter:
                stack.enter_context(bytes_meter)
            runpy.run_path(script_argv[0], run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001 -- printed, recorded, and the exit status says so
        traceback.print_exc()
        code, result["error"] = 1, f"{type(e).__name__}: {e}"
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # from here on, finish the file first
    gc.collect()  # saved tensors kept only by reference cycles (pipelining's stages) are not live
    result.update(exit=code, peak_rss_bytes=peak_rss_bytes())
    if torch.cuda.is_initialized():
        result["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    if bytes_meter:
        result["bytes"] = bytes_meter.report()
    if saved_meter:
        result["saved"] = saved_meter.report()
    with open(os.path.join(a.out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(result, f, indent=1)
    # Leave as Python would (threads joined, exit handlers run) but skip interpreter teardown: gloo aborted a
    # rank there now and then (SIGABRT), and torchrun then killed ranks that had not written their file yet.
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
