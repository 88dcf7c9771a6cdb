"""Data-parallel gradient reduction through one contiguous fp32 buffer split into buckets.

Each parameter's `main_grad` is a view into the buffer. A hook runs when autograd has
accumulated a parameter's gradient: it adds it into `main_grad` and, once every parameter
of a bucket is ready on the last micro-batch, starts that bucket's asynchronous all-reduce
over the DP group, so communication overlaps the rest of the backward pass.
Buckets are filled in reverse parameter order, which is roughly the order in which
backward produces gradients.
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from megalite import parallel_state as ps


class _Bucket:
    def __init__(self, params, data):
        self.params, self.data = params, data
        self.ready, self.handle = set(), None


class DistributedDataParallel(nn.Module):
    def __init__(self, module, bucket_size=40_000_000, overlap_grad_reduce=True):
        super().__init__()
        self.module = module
        self.overlap_grad_reduce = overlap_grad_reduce
        self.sync_enabled = True
        self.dp = ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group()
        params = [p for p in module.parameters() if p.requires_grad]
        total = sum(p.numel() for p in params)
        device = params[0].device if params else torch.device("cpu")
        self.grad_data = torch.zeros(total, dtype=torch.float32, device=device)
        self.buckets, self._bucket_of = [], {}
        offset, start, current = 0, 0, []
        for p in reversed(params):
            n = p.numel()
            p.main_grad = self.grad_data[offset:offset + n].view(p.shape)
            offset += n
            current.append(p)
            if offset - start >= bucket_size:
                self._add_bucket(current, start, offset)
                start, current = offset, []
        if current:
            self._add_bucket(current, start, offset)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    def _add_bucket(self, params, start, end):
        b = _Bucket(params, self.grad_data[start:end])
        self.buckets.append(b)
        for p in params:
            self._bucket_of[p] = b

    def _hook(self, p):
        p.main_grad.add_(p.grad)
        p.grad = None
        if self.sync_enabled and self.overlap_grad_reduce:
            b = self._bucket_of[p]
            b.ready.add(p)
            if len(b.ready) == len(b.params):
                self._start(b)

    def _start(self, b):
        if b.handle is not None:
            return
        if self.dp == 1:
            b.handle = True
            return
        b.data.div_(self.dp)  # average over DP, as Megatron
        b.handle = dist.all_reduce(b.data, group=self.dp_group, async_op=True)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (all micro-batches but the last)."""
        prev, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = prev

    def finish_grad_sync(self):
        """Start any bucket not yet started and wait for all of them."""
        for b in self.buckets:
            self._start(b)
        for b in self.buckets:
            if b.handle is not True:
                b.handle.wait()

    def zero_grad_buffer(self):
        self.grad_data.zero_()
        for b in self.buckets:
            b.ready.clear()
            b.handle = None

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
