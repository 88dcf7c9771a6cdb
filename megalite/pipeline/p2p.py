"""Stage-to-stage communication of activations (forward) and their gradients (backward).

All sends and receives of one step are posted together with batch_isend_irecv, so two
neighbours that send to each other at the same time cannot deadlock. The stages form a
ring (the last stage's "next" is the first stage) so that interleaved schedules can pass a
model chunk's output on to the next chunk on the first stage.

Two message kinds can travel between the same pair of ranks in one step (with PP=2 a
rank's next and previous neighbour are the same rank): activations (tag 0) and gradients
(tag 1). Every rank posts gradient messages before activation messages, so NCCL, which
ignores tags and matches in posting order, pairs them the same way gloo does by tag.
"""

import torch
import torch.distributed as dist


ACTIVATION_TAG, GRADIENT_TAG = 0, 1


class P2P:
    """Sends/receives tensors of one fixed shape and dtype between adjacent stages."""

    def __init__(self, shape, dtype, device, grid):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        g = grid
        ranks, r = list(g.pp_ranks), g.pp_rank
        self.next, self.prev = ranks[(r + 1) % len(ranks)], ranks[(r - 1) % len(ranks)]
        self.group = g.pp_group

    def _empty(self):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device, requires_grad=False)

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """One batched exchange. Returns (tensor from prev, tensor from next)."""
        from_prev = self._empty() if recv_prev else None
        from_next = self._empty() if recv_next else None
        ops = []
        # Gradient-kind messages first (sent to prev, received from next) ...
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, self._check(send_prev), self.prev, self.group, GRADIENT_TAG))
        if from_next is not None:
            ops.append(dist.P2POp(dist.irecv, from_next, self.next, self.group, GRADIENT_TAG))
        # ... then activation-kind messages (sent to next, received from prev).
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, self._check(send_next), self.next, self.group, ACTIVATION_TAG))
        if from_prev is not None:
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev, self.group, ACTIVATION_TAG))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return from_prev, from_next

    def _check(self, t):
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise RuntimeError(f"pipeline p2p: tensor {tuple(t.shape)} {t.dtype} does not match the configured "
                               f"{self.shape} {self.dtype}")
        return t.detach().contiguous()

    # Named helpers, as in Megatron.
    def recv_forward(self):
        return self.communicate(recv_prev=True)[0]

    def send_forward(self, t):
        self.communicate(send_next=t)

    def recv_backward(self):
        return self.communicate(recv_next=True)[1]

    def send_backward(self, t):
        self.communicate(send_prev=t)

    def send_forward_recv_backward(self, t, recv=True):
        return self.communicate(send_next=t, recv_next=recv)[1]

    def send_backward_recv_forward(self, t, recv=True):
        return self.communicate(send_prev=t, recv_prev=recv)[0]
