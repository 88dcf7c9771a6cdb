"""Optimizer CPU offload (Megatron's --optimizer-cpu-offload, --optimizer-offload-fraction F,
--overlap-cpu-optimizer-d2h-h2d): the fp32 main weights and Adam states of a fraction F of a
rank's optimizer elements live in host memory and are stepped there; the rest stay on the device.

As Megatron's hybrid-device optimizer, the split is by whole parameters (ZeRO: whole pieces of
this rank's shard): in each param group, in its flat-buffer order, the parameters that start
within the first F of the group's elements go to the host (F = 0: none, F = 1: all). A host
part is a flat group of its own on CPU (pinned on CUDA): per step its gradients are copied
down into one host buffer (after clipping, which runs on the device), AdamW steps it on the CPU,
and the updated values are copied back into the model's copies (ZeRO: the rank's slices, which
the all-gather then publishes). With --overlap-cpu-optimizer-d2h-h2d the copies are issued
asynchronously on a side stream (every group's gradients first, the device groups stepped
while they travel). The arithmetic is the same elementwise fp32 AdamW wherever an element
lives, so an offloaded run equals one without offload bit for bit.

Bytes moved per step: 4 x host elements down (the fp32 gradients) and param bytes x host
elements up (the model's dtype). On CPU ranks "host" and "device" are both host memory, but
the buffers are separate and the copies real: the code path and the bytes are what runs on a GPU.
"""

import contextlib

import torch



def fraction_for_rank(config, grid):
    """This rank's offload fraction: the flag's one value, or its DP replica's entry of a list (of `grid`)."""
    f = getattr(config, "optimizer_offload_fraction", None)
    if not getattr(config, "optimizer_cpu_offload", False) or f is None:
        return 0.0
    if isinstance(f, (list, tuple)):
        return float(f[grid.data_rank()])
    return float(f)


def host_split(idx, sizes, fraction):
    """(host positions, device positions) of one group: a parameter goes to the host when it
    starts within the first `fraction` of the group's elements."""
    total, start, host, device = sum(sizes), 0, [], []
    for i, n in zip(idx, sizes):
        (host if start < fraction * total else device).append(i)
        start += n
    return host, device


def host_buffer(numel, device):
    """A zeroed fp32 host buffer; pinned when the model lives on CUDA (asynchronous copies)."""
    return torch.zeros(numel, dtype=torch.float32, pin_memory=torch.device(device).type == "cuda")


class OffloadStats:
    """Elements held on the host and the bytes the offload copied (down: gradients, up: weights)."""

    def __init__(self):
        self.host_elements, self.device_elements, self.d2h_bytes, self.h2d_bytes, self.steps = 0, 0, 0, 0, 0


class HostSteps:
    """The host groups' part of one optimizer step. down(grp, grad): the gradients into the
    group's host buffer; step(grp, outs, adamw): AdamW on the CPU (`adamw(main, grad)` runs the
    kernel with the group's hyper-parameters), the new values up into `outs` (the model's
    copies); end(): the device's work after the step waits for the uploads. Overlapped: the copies
    run on a side stream (CUDA) while the device groups step, each host step waits only for its
    own gradients."""

    def __init__(self, stats, overlap, device):
        self.stats, self.events = stats, {}
        self.stream = torch.cuda.Stream(device) if overlap and torch.device(device).type == "cuda" else None

    def _on_side(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def down(self, grp, grad):
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())  # the gradients are final
        with self._on_side():
            grp.grad.copy_(grad, non_blocking=self.stream is not None)
            if self.stream is not None:
                grad.record_stream(self.stream)  # (a gathered copy must outlive the side stream's read)
                self.events[id(grp)] = torch.cuda.Event()
                self.events[id(grp)].record(self.stream)
            elif grad.is_cuda:
                torch.cuda.current_stream().synchronize()
        self.stats.d2h_bytes += grad.numel() * grad.element_size()

    def step(self, grp, outs, adamw):
        if id(grp) in self.events:
            self.events.pop(id(grp)).synchronize()  # this group's gradients are on the host
        adamw(grp.main, grp.grad)
        with self._on_side():
            torch._foreach_copy_(outs, grp.mains, non_blocking=self.stream is not None)
        self.stats.h2d_bytes += sum(o.numel() * o.element_size() for o in outs)

    def end(self):
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
        self.stats.steps += 1
