"""Thin wrappers over the data-parallel collectives that count what each rank moves.

Two figures per collective type, per rank (this process):
- payload: bytes of the full logical tensor (all-reduce: the buffer; reduce-scatter: the
  input; all-gather: the output);
- wire: bytes a bandwidth-optimal (ring) algorithm sends from each rank for that payload
  over a group of d ranks: all-reduce 2(d-1)/d x payload, reduce-scatter and all-gather
  (d-1)/d x payload each. This is the "communication volume" of the ZeRO paper.
`benchmarks/zero_memory.py` compares the wire bytes of a step with the theory.
"""

import collections

import torch.distributed as dist

from megalite import parallel_state as ps

_PAYLOAD = collections.Counter()
_WIRE = collections.Counter()
_CALLS = collections.Counter()

_reduce_scatter, _all_gather = ps.reduce_scatter_tensor, ps.all_gather_tensor


def _record(op, tensor, group, factor):
    d = dist.get_world_size(group)
    nbytes = tensor.numel() * tensor.element_size()
    _PAYLOAD[op] += nbytes
    _WIRE[op] += factor * (d - 1) / d * nbytes
    _CALLS[op] += 1


def record_sent(op, payload, wire):
    """For collectives whose wire bytes are not a fixed factor of the payload (uneven all-to-all)."""
    _PAYLOAD[op] += payload
    _WIRE[op] += wire
    _CALLS[op] += 1


def all_reduce(tensor, group=None, async_op=False, op=dist.ReduceOp.SUM):
    _record("all_reduce", tensor, group, 2)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(output, input, group=None, async_op=False):
    """Sum `input` (d equal chunks) over the group; this rank's chunk lands in `output`."""
    _record("reduce_scatter", input, group, 1)
    return _reduce_scatter(output, input, group=group, async_op=async_op)


def all_gather(output, input, group=None, async_op=False):
    """Concatenate every rank's `input` into `output` (d x input elements)."""
    _record("all_gather", output, group, 1)
    return _all_gather(output, input, group=group, async_op=async_op)


def counts():
    """{op: {"calls", "payload_bytes", "wire_bytes"}} since the last reset()."""
    return {op: {"calls": _CALLS[op], "payload_bytes": _PAYLOAD[op], "wire_bytes": _WIRE[op]} for op in _CALLS}


def reset():
    _PAYLOAD.clear()
    _WIRE.clear()
    _CALLS.clear()
