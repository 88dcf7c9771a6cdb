"""A torch.distributed backend for the suite's forked CPU ranks: collectives through shared memory.

Why: the suite's worlds run 4-8 ranks on 2 cores, and a world's time is its collectives' latency. gloo's TCP
transport runs a polling event-loop thread per group; a step of five small layers and a 4 KB all-reduce took 2.2 ms
at 4 ranks and 14 ms at 8 on gloo here, against 0.4 and 0.9 ms through this backend (benchmarks/shm_vs_gloo.py).
Members copy their parts into a /dev/shm file every one of them maps, and wait on futexes, so a waiting rank gives
its core to the rank it waits for.

Semantics as gloo's, where a test could tell: a collective posts this member's part when it is called and writes
its outputs when its handle is waited for (torch waits at once unless async_op=True), in call order per group, so
code that reads an output before wait() reads stale values here, not a lucky result. Sends are buffered; a
receive completes at its handle's wait(), after the same source's earlier receives, matched by tag. Reductions add
the members' parts in member order, so every member gets the same bits.

The suite's worlds use it by default (tests/support/dist_util.py); the groups megalite asks for by name (its checkpoint
writer's, the asynchronous outer optimizer's `backend="gloo"`) stay gloo, and torchrun jobs run gloo throughout.
x86-64 Linux only: a post relies on x86 keeping plain stores in order (the data, then the counter that publishes it).
"""

import contextlib
import ctypes
import glob
import mmap
import os
import platform
import threading
import time
import uuid
from collections import deque

import torch
import torch.distributed as dist

from shm_messages import _CTRL, NAME, Messages, _nbytes, _padded, _Work

PARTS = 64 << 20  # bytes of a member's posted parts that some member has not yet completed, per group
_ENTRIES = 1024  # collectives a member can have posted that some member has not yet completed
RING = 32 << 20  # bytes in flight from one member to another (sent, not yet received)
_POLL_S = 0.2  # how often a waiting member checks that the one it waits for is alive
_FUTEX = {"x86_64": 202}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_POLL = _Timespec(0, int(_POLL_S * 1e9))


_PREFIX = "/dev/shm/megalite-tests-"  # + the process group's id: what a crashed world leaves, removed at exit


def available():
    return _FUTEX is not None and os.path.isdir("/dev/shm")


def register():
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, ShmGroup, devices=["cpu"])


def remove_leftovers():
    """The files of groups some member never mapped (its world failed first): a group's file is unlinked once every
    member has it mapped, so after the session only those are left."""
    for name in glob.glob(f"{_PREFIX}{os.getpgrp()}-*"):
        with contextlib.suppress(OSError):
            os.unlink(name)


class ShmGroup(Messages, dist.ProcessGroup):
    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self._rank, self._size, self._timeout = rank, size, timeout.total_seconds()
        self._parts, self._ring_bytes = PARTS, RING  # (as the module says when the group is made: tests shrink them)
        self._meta = _padded(8 * size)  # a part starts with the member's split sizes (int64 words)
        self._index_at = _CTRL * size  # per member: where each of its posted parts starts in its ring
        self._parts_at = self._index_at + size * _ENTRIES * 8
        self._rings_at = self._parts_at + size * self._parts
        total = self._rings_at + size * size * (_CTRL + self._ring_bytes)
        if rank == 0:
            path = f"{_PREFIX}{os.getpgrp()}-{uuid.uuid4().hex}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, total)  # sparse: a page exists once written
            store.set("shm_path", path)
        else:
            path = store.get("shm_path").decode()
            fd = os.open(path, os.O_RDWR)
        self._mm = mmap.mmap(fd, total)
        os.close(fd)
        if store.add("shm_opened", 1) == size:
            os.unlink(path)  # every member has it mapped: the memory goes with the last of them
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._posted = [self._word(m * _CTRL) for m in range(size)]
        self._completed = [self._word(m * _CTRL + 64) for m in range(size)]
        self._pids = [self._word(m * _CTRL + 128) for m in range(size)]
        self._pids[rank].value = os.getpid()
        self._index = [(ctypes.c_int64 * _ENTRIES).from_buffer(self._mm, self._index_at + m * _ENTRIES * 8)
                       for m in range(size)]
        self._ops, self._open = 0, []  # collectives posted; those not yet completed, in order
        self._written, self._starts = 0, deque()  # bytes posted to this member's ring; (op, where its part starts)
        self._lock = threading.RLock()
        self._receives = {m: [] for m in range(size)}  # posted, not yet waited for, per source
        self._stash = {m: [] for m in range(size)}  # (tag, bytes) taken from a source's ring, not yet matched
        # (no barrier: a member may post before the others have mapped the file, whose bytes wait for them)

    def _word(self, at):
        return ctypes.c_int64.from_buffer(self._mm, at)

    def _wait_until(self, word, target, member, what):
        """Until the counter `word` (one writer, only grows) reaches `target`; fails when `member`, who moves it,
        has ended, or after the group's timeout."""
        if word.value >= target:
            return
        addr = ctypes.addressof(word)  # the futex is the counter's low half (little-endian)
        start = checked = time.monotonic()
        while True:
            seen = word.value
            if seen >= target:
                return
            _libc.syscall(_FUTEX, ctypes.c_void_p(addr), 0, ctypes.c_int32(seen), ctypes.byref(_POLL), None, 0)
            now = time.monotonic()
            if now - checked >= _POLL_S:
                checked = now
                pid = self._pids[member].value
                if pid and not _alive(pid):
                    raise RuntimeError(f"{NAME}: Connection closed by peer: member {member} (pid {pid}) ended "
                                       f"while this rank waited for its {what}")
                if now - start > self._timeout:
                    raise RuntimeError(f"{NAME}: Timed out after {self._timeout:.0f} s waiting for member "
                                       f"{member}'s {what}")

    def _publish(self, word, value):
        word.value = value
        _libc.syscall(_FUTEX, ctypes.c_void_p(ctypes.addressof(word)), 1, ctypes.c_int32(2 ** 31 - 1), None, None, 0)

    # -- collectives: post this member's part now, read every member's at wait() ----------------

    def _collective(self, tensors, read, result, splits=()):
        """Posts the tensors' bytes (each from a 64-byte boundary) and the split sizes as this member's part of
        the group's next collective; the handle's wait() completes the group's collectives up to this one:
        read(op) takes what it needs from the members' parts. A part's bytes are reused once every member has
        completed its collective."""
        offsets, end = _layout(tensors)
        size = self._meta + end
        if size > self._parts:
            raise RuntimeError(f"{NAME}: a collective part of {size} bytes exceeds the group's {self._parts} "
                               "(tests/support/shm_group.py PARTS)")
        with self._lock:
            op = self._ops = self._ops + 1
            w = self._written
            if w % self._parts + size > self._parts:  # a part never wraps: the rest of the ring is skipped
                w += self._parts - w % self._parts
            oldest = op - _ENTRIES  # the latest collective whose index entry or bytes this one reuses
            for o, start in self._starts:  # (in order)
                if start >= w + size - self._parts:
                    break
                oldest = max(oldest, o)
            self._wait_completed(oldest)
            at = self._parts_at + self._rank * self._parts + w % self._parts
            meta = (ctypes.c_int64 * max(1, len(splits))).from_buffer(self._mm, at)
            for i, s in enumerate(splits):
                meta[i] = s
            at += self._meta
            for t, o in zip(tensors, offsets):
                self._bytes[at + o:at + o + _nbytes(t)].view(t.dtype).view(t.shape).copy_(t)
            self._index[self._rank][op % _ENTRIES] = w
            self._starts.append((op, w))
            self._written = w + size
            self._publish(self._posted[self._rank], op)  # after the data: x86 keeps stores in order
            self._open.append((op, read))
        return _Work(lambda: self._complete_through(op), result)

    def _wait_completed(self, op):
        """Until every member has completed collective `op` (this one first), so that its part can go."""
        if op <= 0:
            return
        self._complete_through(op)
        for m in range(self._size):
            self._wait_until(self._completed[m], op, m, "completion of an earlier collective")
        while self._starts and self._starts[0][0] <= op:
            self._starts.popleft()

    def _complete_through(self, op):
        with self._lock:
            while self._open and self._open[0][0] <= op:
                first, read = self._open[0]
                for m in range(self._size):
                    self._wait_until(self._posted[m], first, m, "part of a collective")
                read(first)
                self._open.pop(0)
                self._publish(self._completed[self._rank], first)

    def _at(self, member, op):
        return self._parts_at + member * self._parts + self._index[member][op % _ENTRIES] % self._parts

    def _part(self, member, op, dtype, count, byte_offset=0):
        """`count` elements of dtype from member's part of collective `op`, from byte_offset."""
        start = self._at(member, op) + self._meta + byte_offset
        return self._bytes[start:start + count * dtype.itemsize].view(dtype)

    def _splits(self, member, op):
        return list((ctypes.c_int64 * self._size).from_buffer(self._mm, self._at(member, op)))

    def _reduce_into(self, out, op, byte_offset, reduce_op):
        out.copy_(_reduce([self._part(m, op, out.dtype, out.numel(), byte_offset).view(out.shape)
                           for m in range(self._size)], reduce_op))

    def allreduce(self, tensors, opts=None):
        def read(op):
            for t, o in zip(tensors, _layout(tensors)[0]):
                self._reduce_into(t, op, o, _op(opts))
        return self._collective(tensors, read, tensors)

    allreduce_coalesced = allreduce

    def barrier(self, opts=None):
        return self._collective((), lambda op: None, None)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts else 0

        def read(op):
            if self._rank != root:
                for t, o in zip(tensors, _layout(tensors)[0]):
                    t.copy_(self._part(root, op, t.dtype, t.numel(), o).view(t.shape))
        return self._collective(tensors if self._rank == root else (), read, tensors)

    def allgather(self, outputs, inputs, opts=None):
        def read(op):
            for outs, t, o in zip(outputs, inputs, _layout(inputs)[0]):
                for m, out in enumerate(outs):
                    out.copy_(self._part(m, op, t.dtype, t.numel(), o).view(out.shape))
        return self._collective(inputs, read, outputs)

    allgather_coalesced = allgather

    def all_gather_single(self, output, input, opts=None):
        def read(op):
            rows = output.view(self._size, -1)
            for m in range(self._size):
                rows[m].copy_(self._part(m, op, input.dtype, input.numel()))
        return self._collective([input], read, [output])

    _allgather_base = all_gather_single

    def reduce_scatter(self, outputs, inputs, opts=None):
        chunks = [c.contiguous() for cs in inputs for c in cs]

        def read(op):
            offsets = _layout(chunks)[0]
            for i, out in enumerate(outputs):
                self._reduce_into(out, op, offsets[i * self._size + self._rank], _op(opts))
        return self._collective(chunks, read, outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        def read(op):
            self._reduce_into(output, op, self._rank * _nbytes(output), _op(opts))
        return self._collective([input], read, [output])

    _reduce_scatter_base = reduce_scatter_single

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        n = self._size
        row_in = input[0].numel() if input.dim() and input.shape[0] else 0
        row_out = output[0].numel() if output.dim() and output.shape[0] else 0
        in_splits = list(input_splits) or [input.shape[0] // n] * n
        out_splits = list(output_splits) or [output.shape[0] // n] * n
        if not output.is_contiguous():
            raise RuntimeError(f"{NAME}: all_to_all_single needs a contiguous output")

        def read(op):
            flat, at = output.view(-1), 0
            for m in range(n):
                count, sent = out_splits[m] * row_out, self._splits(m, op)[:self._rank]
                flat[at:at + count].copy_(self._part(m, op, output.dtype, count, sum(sent) * output.element_size()))
                at += count
        return self._collective([input], read, [output], [s * row_in for s in in_splits])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        def read(op):
            for m, out in enumerate(outputs):
                sent = self._splits(m, op)[:self._rank]
                out.copy_(self._part(m, op, out.dtype, out.numel(), sum(sent) * out.element_size()).view(out.shape))
        return self._collective([torch.cat([t.reshape(-1) for t in inputs])], read, outputs,
                                [t.numel() for t in inputs])

    def gather(self, outputs, inputs, opts=None):
        root = opts.rootRank if opts else 0

        def read(op):
            if self._rank == root:
                for m, out in enumerate(outputs[0]):
                    out.copy_(self._part(m, op, out.dtype, out.numel()).view(out.shape))
        return self._collective(inputs, read, outputs)

    def scatter(self, outputs, inputs, opts=None):
        root, out = (opts.rootRank if opts else 0), outputs[0]
        chunks = [t.contiguous() for t in inputs[0]] if self._rank == root else ()

        def read(op):
            at = _padded(_nbytes(out)) * self._rank  # the root's equal chunks, each from a 64-byte boundary
            out.copy_(self._part(root, op, out.dtype, out.numel(), at).view(out.shape))
        return self._collective(chunks, read, outputs)

    def reduce(self, tensors, opts=None):
        root = opts.rootRank if opts else 0

        def read(op):
            if self._rank == root:
                self._reduce_into(tensors[0], op, 0, _op(opts))
        return self._collective(tensors[:1], read, tensors)

    # -- what torch asks of a group ----------------------------------------------------------

    def size(self):
        return self._size

    def getBackendName(self):
        return NAME

    # torch names a group through its backends, of which a Python group has none: the names are kept here
    def _set_group_name(self, name):
        self._group_name = name

    @property
    def group_name(self):
        return self._group_name

    def _set_group_desc(self, desc):
        self._group_desc = desc

    @property
    def group_desc(self):
        return self._group_desc

    def __repr__(self):
        return f"ShmGroup(member {self._rank} of {self._size})"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _layout(tensors):
    """Each tensor's byte offset in a part (each from a 64-byte boundary), and the part's size."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end = _padded(end + _nbytes(t))
    return offsets, end


def _op(opts):
    return opts.reduceOp if opts is not None else dist.ReduceOp.SUM


_REDUCE = {dist.ReduceOp.SUM: torch.Tensor.add_, dist.ReduceOp.PRODUCT: torch.Tensor.mul_,
           dist.ReduceOp.MAX: lambda a, b: torch.maximum(a, b, out=a),
           dist.ReduceOp.MIN: lambda a, b: torch.minimum(a, b, out=a), dist.ReduceOp.BAND: torch.Tensor.bitwise_and_,
           dist.ReduceOp.BOR: torch.Tensor.bitwise_or_, dist.ReduceOp.BXOR: torch.Tensor.bitwise_xor_}


def _reduce(parts, op):
    """The parts combined in member order, so that every member gets the same bits."""
    combine = next((f for k, f in _REDUCE.items() if op == k), None)
    if combine is None:
        raise RuntimeError(f"{NAME}: reduce op {op} is not supported (nor by gloo)")
    out = parts[0].clone()
    for p in parts[1:]:
        combine(out, p)
    return out
