"""The auxiliary losses' bookkeeping (the MoE routers' load-balancing and z-losses, DSA's indexer loss,
multi-token prediction's per depth): an AuxLossTracker holds their gradient scale, which the schedule sets before
each iteration's backward passes (Megatron's MoEAuxLossAutoScaler.set_loss_scale: the loss scale over the
micro-batch count; per-token loss: the loss scale), and their values per layer, which the log line reads and
clears (training/auxiliary_losses.py). Every module that records one has an `aux_tracker` (its own at first);
`share_tracker` hands one tracker to all of them in a rank's model chunks (training/setup.py, GPTModel)."""

import torch


class AuxLossTracker:
    def __init__(self):
        self.scale = 1.0
        self.values = {}  # name -> {layer number: summed value over the micro-batches (detached, fp32)}

    def record(self, name, layer_number, value):
        per_layer = self.values.setdefault(name, {})
        per_layer[layer_number] = per_layer.get(layer_number, 0.0) + value.detach().float()

    def clear(self):
        self.values.clear()


class AuxLossScaler(torch.autograd.Function):
    """Identity on `output` whose backward also sends the tracker's scale (at backward time) as the gradient of
    `aux_loss`."""

    @staticmethod
    def forward(ctx, output, aux_loss, tracker):
        ctx.save_for_backward(aux_loss)
        ctx.tracker = tracker
        return output

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.tracker.scale), None


def trackers(chunks):
    """The distinct trackers of the recording modules in these chunks. A chunk whose model declares one
    (GPTModel; a DDP wrapper's module) shares it with all its recording modules (share_tracker): that one, without
    walking the modules on every schedule call; other models' modules are walked."""
    found = {}
    for c in chunks:
        model = getattr(c, "module", c)
        own = getattr(model, "aux_tracker", None)
        for t in [own] if own is not None else (getattr(m, "aux_tracker", None) for m in c.modules()):
            if t is not None:
                found.setdefault(id(t), t)
    return list(found.values())


def share_tracker(chunks):
    """One tracker for every recording module of these chunks (and every module that declares `aux_tracker`,
    e.g. the model itself); returns it."""
    tracker = AuxLossTracker()
    for c in chunks:
        for m in c.modules():
            if hasattr(m, "aux_tracker"):
                m.aux_tracker = tracker
    return tracker


def set_aux_loss_scale(chunks, scale):
    """The schedules call this before each iteration's backward passes."""
    for t in trackers(chunks):
        t.scale = float(scale)
