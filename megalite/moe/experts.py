"""The experts of an MoE layer held by this rank: L feed-forward blocks (megalite's MLP at
--moe-ffn-hidden-size), named and initialised by their global expert index
(`experts.local_experts.<e>`, Megatron's SequentialMLP names), so a checkpoint means the same
expert whatever the expert-parallel layout. Their parameters are marked `expert_parallel`: their
gradients reduce, and ZeRO shards them, over the expert-data-parallel group, not the dense one
(megalite/distributed/param_facts.py). By default they run one after the other on their rows
(Megatron's sequential path). With --moe-grouped-gemm and rows on CUDA, all local experts' fc1,
activation and fc2 run as two Triton grouped GEMMs (kernels/grouped_gemm.py) over the experts'
weights: the same function, the parameters still separate (same names, each its own gradient).
On CPU --moe-grouped-gemm keeps the loop. Any expert-TP size: an expert's layers hold their
expert-TP shards and do not communicate (the dispatcher does), so the shards multiply alike."""

import dataclasses

import torch
from torch import nn

from kernels.grouped_gemm import grouped_gemm
from megalite.moe.activation import activation, kernel_backend


def expert_key(first, i):
    """The name of this rank's i-th expert: its global index."""
    return str(first + i)


class SequentialExperts(nn.Module):
    def __init__(self, config, prefix, mlp_class, first=0, count=None, grid=None):
        """mlp_class: the transformer's feed-forward block (given by the layer, which owns it);
        first, count: the global indices of this rank's experts."""
        super().__init__()
        c = dataclasses.replace(config, ffn_hidden_size=config.moe_ffn_hidden_size)
        count = config.num_moe_experts if count is None else count
        self.config = c
        self.first = first
        # keyed by global index: the parameters' names (checkpoint names) are the same at every EP size
        self.local_experts = nn.ModuleDict({expert_key(first, i): mlp_class(c, f"{prefix}.local_experts.{first + i}",
                                                                            expert=True, grid=grid)
                                            for i in range(count)})
        for p in self.parameters():
            p.expert_parallel = True

    def forward(self, rows, counts, grouped=None, sources=None):
        """rows [N, h] sorted by local expert, counts[l] of them for expert l -> outputs [N, h].
        grouped: None: the grouped GEMMs when --moe-grouped-gemm and the rows are on CUDA; True /
        False forces one path (tests compare them on CPU under the Triton interpreter).
        sources: (each row's micro-batch index, how many): FP8 experts run on each micro-batch's rows apart."""
        if grouped is None:
            grouped = self.wants_grouped(rows)
        if grouped:
            return grouped_experts(self.config, list(self.local_experts.values()), rows, counts)
        outs = []
        # an expert with no rows still runs (on zero rows): its weights get a (zero) gradient, so
        # every rank's gradient hooks fire and the data-parallel buckets reduce in the same order
        split = [None] * len(counts) if sources is None else torch.split(sources[0], counts)
        for expert, x, src in zip(self.local_experts.values(), torch.split(rows, counts), split):
            outs.append(_run(expert, x) if src is None else by_micro_batch(expert, x, src, sources[1]))
        return torch.cat(outs)

    def wants_grouped(self, rows):
        """--moe-grouped-gemm on CUDA rows, unless the experts run in FP8 (the grouped kernel has no FP8 path:
        their GEMMs one by one)."""
        return bool(self.config.moe_grouped_gemm and rows.is_cuda and not self.in_fp8())

    def in_fp8(self):
        """(attach_fp8 gives every expert's layers their sites at once: the first expert's fc1 tells; per forward)"""
        return next(iter(self.local_experts.values())).linear_fc1.fp8 is not None


def _run(expert, x):
    y, bias = expert(x)
    return y if bias is None else y + bias


def by_micro_batch(expert, x, src, count):
    """The expert on the rows of each micro-batch apart (src: each row's), its outputs in the rows' order. An FP8
    GEMM's tensorwise scale (and a row-wise or blockwise weight gradient's scales along the tokens) is of one
    micro-batch's rows in one process; under expert parallelism an expert gets several micro-batches' rows at once,
    so it runs each micro-batch's as that process does (its weight gradient the sum of theirs)."""
    parts = [i for i in (torch.nonzero(src == m).squeeze(1) for m in range(count)) if i.numel()]
    if len(parts) <= 1:  # (one micro-batch, or none: an expert without rows still runs, on none)
        return _run(expert, x)
    order = torch.cat(parts)
    return torch.cat([_run(expert, x[i]) for i in parts])[torch.argsort(order)]


def _weights_ready(layer):
    """--overlap-param-gather waits for a layer's parameter all-gather in that layer's forward
    pre-hook (megalite/distributed/grad_buffer.py); the grouped path reads the weights without
    calling the layers, so it runs their pre-hooks itself."""
    for key, hook in layer._forward_pre_hooks.items():
        hook(layer, (), {}) if key in layer._forward_pre_hooks_with_kwargs else hook(layer, ())


def grouped_experts(c, experts, rows, counts):
    """Every expert's fc1 -> activation -> fc2 on its rows as two grouped GEMMs. The weights go in
    as lists of the experts' own parameters (kernels.grouped_gemm stacks them for the kernel and
    again in the backward, so no stacked copy is kept for the backward; an expert with no rows gets
    a zero gradient, as in the loop)."""
    fc1 = [e.linear_fc1 for e in experts]
    fc2 = [e.linear_fc2 for e in experts]
    for layer in fc1 + fc2:
        _weights_ready(layer)
    with kernel_backend(c.fused_kernels):
        h = grouped_gemm(rows, [m.weight for m in fc1], counts)
        return grouped_gemm(activation(c, h), [m.weight for m in fc2], counts)
