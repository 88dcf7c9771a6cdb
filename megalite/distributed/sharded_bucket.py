"""One bucket of the ZeRO (distributed-optimizer) data-parallel buffers.

A bucket covers a run of parameters laid out back to back and is padded to a multiple of
the DP size d, so it splits into d equal contiguous shards; DP rank r owns shard r of
every bucket. A parameter may straddle shard boundaries: each rank then owns a "piece" of
it (param-local elements [start, end)), possibly empty.

Stage 1: the fp32 gradient buffer is full size; the last micro-batch reduce-scatters it
(averaged over DP) and only the owned shard is meaningful afterwards.
Stage 2: every micro-batch reduce-scatters, the result is added to a persistent fp32
shard accumulator, and the full-size buffer's storage is released (resized to zero)
until the next micro-batch's first gradient for this bucket arrives. With uneven data-parallel
shares (reduce_every_microbatch off) it accumulates the full buffer over the iteration and
reduce-scatters once, as every rank must issue the same collectives.
Parameters (model dtype) live in a flat buffer with the same layout, so the updated
shards are all-gathered bucket by bucket in place.
Stage 3 (ZeRO-3 / FSDP): gradients as stage 2, and the parameters too are sharded: a rank
keeps its shard in `param_shard` (the optimizer's pieces view it) and the bucket's full
buffer has storage only while its unit is gathered (`param_units.py` decides when). Views
of the buffer that autograd saved in a forward become valid again when it is re-gathered;
the parameters themselves point at a one-element NaN (expanded to their shape) while freed,
so reading a freed parameter yields NaN, never freed memory.
"""

import torch
from torch import nn

from megalite.distributed import comm
from megalite.tensor_parallel.init import materialize


def adopt(param, tensor):
    """A meta-device parameter takes `tensor` as its storage: the same Python object (modules,
    hooks and attributes keep it), now on tensor's device."""
    fresh = nn.Parameter(torch.empty(0, dtype=tensor.dtype, device=tensor.device), requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, fresh)
    param.__dict__.update(fresh.__dict__)  # the attributes moved with the swap: take them back
    # .data, not the Parameter's constructor: a version counter of its own, so gathers into the
    # flat buffer do not look like in-place changes of a tensor autograd saved
    param.data = tensor


class Piece:
    """The part of `param` this rank owns: param-local [start, end)."""

    def __init__(self, param, start, end, grad, data):
        self.param, self.start, self.end = param, start, end
        self.grad = grad  # fp32 1-D view holding the reduced gradient after the sync
        self.data = data  # 1-D view into the model's parameter buffer (model dtype)


class ShardedBucket:
    wire_dtype = None  # --grad-reduce-in-bf16: what the reduce-scatter sends (the fp32 bucket rounded to it)

    def __init__(self, params, padded, stage, grad, param_data, dp, dp_rank, group, divisor=None):
        """dp, dp_rank, group: the ranks that shard (DP x CP); divisor: the gradient average's
        (DP; default dp)."""
        self.params, self.stage, self.dp, self.group = params, stage, dp, group
        self.divisor = dp if divisor is None else divisor
        self.padded, self.shard = padded, padded // dp
        self.lo, self.hi = dp_rank * self.shard, (dp_rank + 1) * self.shard
        self.param_data = param_data
        self.ready, self.state, self._handle, self._out, self.param_handle = set(), "idle", None, None, None
        self.reduce_every_microbatch = stage >= 2
        self.param_shard, self.gather_handle, self.backward_seen = None, None, set()
        self.wire = self.fp8_gather = None  # --fp8-param-gather (distributed/fp8_gather.py)
        if stage == 1:
            self.data, self.shard_acc = grad, None
        else:
            self.data = torch.zeros(padded, dtype=torch.float32, device=param_data.device)
            self.shard_acc = torch.zeros(self.shard, dtype=torch.float32, device=param_data.device)
        self.pieces, offset, born_meta = [], 0, set()
        for p in params:
            n = p.numel()
            view = param_data[offset:offset + n]
            if p.is_meta:  # built by ps.meta_init(): only this rank's shard is made, below
                adopt(p, view.view(p.shape))
                born_meta.add(p)
            else:
                view.copy_(p.data.reshape(-1))
                p.data = view.view(p.shape)  # the parameter now lives in the flat buffer
            p.main_grad = self.data[offset:offset + n].view(p.shape)
            a, b = max(offset, self.lo), min(offset + n, self.hi)
            b = max(a, b)
            g = self.data[a:b] if stage == 1 else self.shard_acc[a - self.lo:b - self.lo]
            p.main_grad_shard = g  # read by finalize_model_grads (SP / tied-embedding sums)
            if b > a:
                self.pieces.append(Piece(p, a - offset, b - offset, g, param_data[a:b]))
                self.pieces[-1].flat = (a, b)  # where the piece sits in the bucket
            offset += n
        if stage >= 2:
            self._release()
        if stage == 3:
            self._views = [(p, p.data) for p in params]
            self._freed = torch.full((1,), float("nan"), dtype=param_data.dtype, device=param_data.device)
            self.param_shard = param_data[self.lo:self.hi].clone()
            for pc in self.pieces:
                pc.data = self.param_shard[pc.flat[0] - self.lo:pc.flat[1] - self.lo]
                if pc.param in born_meta:
                    pc.data.copy_(materialize(pc.param, pc.start, pc.end, pc.data.device))
            self.release_params()
        elif born_meta:
            raise ValueError("parameters built on the meta device need ZeRO-3 (--zero-stage 3)")

    # -- stage-2 storage of the full-size buffer --------------------------------------
    def _allocated(self):
        return self.data.untyped_storage().nbytes() > 0

    def _release(self):
        self.data.untyped_storage().resize_(0)

    def _allocate(self):
        self.data.untyped_storage().resize_(self.padded * self.data.element_size())
        self.data.zero_()

    # -- gradients ---------------------------------------------------------------------
    def accumulate(self, p):
        if self.stage >= 2:
            if self.state == "inflight":  # last micro-batch's reduction of this bucket
                self.finish()
            if not self._allocated():
                self._allocate()
        p.main_grad.add_(p.grad)

    def pending(self):
        """Whether gradients wait to be handed to a reduction (this round)."""
        return self.state == "idle" and (self.stage == 1 or self._allocated())

    def start(self):
        if not self.pending():
            return
        self.ready.clear()
        self.state = "inflight"
        if self.divisor > 1:  # average over DP, as Megatron (summed over CP); also where an expert
            self.data.div_(self.divisor)  # group is one rank (EP = DP: nothing to reduce, still averaged)
        if self.dp > 1:
            # A separate output: an output aliasing the input is not safe on every backend.
            wire = self.wire_dtype or torch.float32
            self._out = torch.empty(self.shard, dtype=wire, device=self.data.device)
            self._handle = comm.reduce_scatter(self._out, self.data.to(wire), group=self.group, async_op=True)

    def finish(self):
        if self.state != "inflight":
            return
        if self.dp > 1:
            self._handle.wait()
            own = self._out.float()  # (a no-op in fp32)
        else:
            own = self.data[self.lo:self.hi]
        if self.stage == 1:
            if self.dp > 1:
                self.data[self.lo:self.hi].copy_(own)
            self.state = "reduced"  # until zero(): one reduction per iteration
        else:
            self.shard_acc.add_(own)
            self._release()
            self.state = "idle"  # stage 2 reduces again on the next micro-batch
        self._out = self._handle = None

    def zero(self):
        if self.stage == 1:
            self.data.zero_()
        else:
            self.shard_acc.zero_()
            if self._allocated():
                self._release()
        self.ready.clear()
        self.state, self._out, self._handle = "idle", None, None

    # -- parameters --------------------------------------------------------------------
    def start_param_gather(self):
        if self.stage == 3:  # the shards changed: gathered copies are stale (re-gathered on use)
            self.release_params()
            return
        if self.fp8_gather is not None:  # --fp8-param-gather: FP8 bytes for the FP8 weights (fp8_gather.py)
            if self.param_handle is None:
                self.fp8_gather.start(self, async_op=True)
                self.param_handle = "fp8"
            return
        if self.dp == 1 or self.param_handle is not None:
            return
        own = self.param_data[self.lo:self.hi].clone()  # gloo/NCCL: input must not alias output
        self.param_handle = comm.all_gather(self.param_data, own, group=self.group, async_op=True)

    def finish_param_gather(self):
        if self.param_handle == "fp8":
            self.fp8_gather.finish(self)
        elif self.param_handle is not None:
            self.param_handle.wait()
        self.param_handle = None

    # -- stage 3: the full parameters exist only while gathered -------------------------
    def params_allocated(self):
        return self.param_data.untyped_storage().nbytes() > 0

    def gather_params(self, async_op=True):
        """Materialise the full parameters from the shards (returns False if they already were)."""
        if self.params_allocated():
            return False
        self.param_data.untyped_storage().resize_(self.padded * self.param_data.element_size())
        for p, view in self._views:
            p.data = view
        if self.fp8_gather is not None and self.fp8_gather.ready():  # --fp8-param-gather: FP8 bytes (fp8_gather.py)
            self.fp8_gather.start(self, async_op)
            self.gather_handle = "fp8"
            if not async_op:
                self.wait_params()
        elif self.dp == 1:
            self.param_data.copy_(self.param_shard)
        else:
            self.gather_handle = comm.all_gather(self.param_data, self.param_shard, group=self.group,
                                                 async_op=async_op)
            if not async_op:
                self.gather_handle = None
        return True

    def wait_params(self):
        if self.gather_handle == "fp8":
            self.fp8_gather.finish(self)
        elif self.gather_handle is not None:
            self.gather_handle.wait()
        self.gather_handle = None

    def release_params(self):
        self.wait_params()  # never free a buffer a collective still writes
        if self.params_allocated():
            self.param_data.untyped_storage().resize_(0)
            for p, _ in self._views:
                p.data = self._freed.expand(p.shape)
                if getattr(p, "fp8_bytes", None) is not None:  # (its FP8 copy goes with it)
                    p.fp8_bytes = p.fp8_weight = None
        self.backward_seen.clear()

    def param_bytes(self):
        return self.padded * self.param_data.element_size()
