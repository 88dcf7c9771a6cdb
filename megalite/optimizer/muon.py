"""Muon's whole matrices: which parameters Muon takes, what counts as one matrix, and where each is
orthogonalised (DESIGN.md, Seams: "Whole matrices").

Muon takes every 2-D weight except embeddings, the output layer and routers (those, with norms and
biases, go to --muon-scalar-optimizer). One matrix is one parameter's global (TP = 1) weight, except
the fused QKV weight, which is three (all heads' q rows, k rows, v rows; Megatron's default, undone
by --muon-no-split-qkv); SwiGLU's fused fc1 and MLA's projections stay one matrix each, an expert's
weight is its own matrix (as Megatron's).

Under TP (`--muon-tp-mode`): duplicated gathers the matrix over TP and every TP rank orthogonalises
it (keeping its shard); distributed shards the Newton-Schulz steps over TP (a Gram all-reduce per
step, newton_schulz.py); blockwise orthogonalises each shard alone (TP-dependent, as Megatron's).
Under ZeRO each matrix has one owner among the ranks that shard it (balanced by Newton-Schulz FLOPs,
decided once here): one all-to-all brings the owner every rank's piece of the momentum, the owner
orthogonalises it once, a second all-to-all returns each piece's update to the rank that holds it.
Buckets, ZeRO pieces and checkpoints keep their own layout. Without ZeRO every data-parallel rank
holds whole matrices and orthogonalises all of them (as Megatron's non-distributed Muon).
"""

import torch
import torch.distributed as dist

from megalite.distributed import comm
from megalite.distributed.param_facts import tensor_parallel
from megalite.optimizer import updates
from megalite.optimizer.newton_schulz import flops, newton_schulz, scale_factor


def is_muon_matrix(param):
    return (param.ndim == 2 and getattr(param, "use_muon", True)
            and not getattr(param, "is_embedding_or_output_parameter", False)
            and not getattr(param, "is_embedding_parameter", False))


class Holding:
    """A Muon parameter as this rank holds it: `ranges[r]` = the local flat [start, end) the r-th rank of
    `group` (ZeRO's sharding group, size d) holds; whole matrices: d = 1, one range over all of it."""

    def __init__(self, param, ranges, group=None, rank=0):
        self.param, self.ranges, self.group, self.rank = param, ranges, group, rank
        self.mine = ranges[rank]


class MuonMatrices:
    def __init__(self, holdings, config, tp_size=None):
        """tp_size(p): the TP size p is sharded over (default: the grid's, param_facts; the planner passes its
        layout's)."""
        c = config
        self.c, self.holdings = c, holdings
        self.tp_size = tp_size or (lambda p: tensor_parallel(p)[0])
        self.stats = {"ns_flops": 0, "matrices": 0}  # this rank's Newton-Schulz work (benchmarks, tests)
        self.plans = []  # per sharding group: (group, d, rank, holdings, owner per holding)
        by_group = {}
        for h in holdings:
            if len(h.ranges) > 1:
                by_group.setdefault(h.group, []).append(h)
        for group, hs in by_group.items():
            d = len(hs[0].ranges)
            self.plans.append((group, d, hs[0].rank, hs, balanced_owners([self.cost(h.param) for h in hs], d)))

    # -- what one matrix costs and how it is orthogonalised --------------------------------------------
    def _parts(self, p, m):
        """The matrices of a local (TP-shard) weight m: QKV's three, else m."""
        split = getattr(p, "qkv_split_shapes", None) if self.c.muon_split_qkv else None
        if split is None:
            return [m], None
        g = m.view(-1, sum(split), m.shape[-1])  # [query groups, q + k + v rows, in]
        return [t.reshape(-1, m.shape[-1]) for t in torch.split(g, split, dim=1)], g.shape

    def _global_shape(self, p, shape):
        tp = self.tp_size(p)
        if tp > 1 and getattr(p, "tensor_model_parallel", False) and self.c.muon_tp_mode != "blockwise":
            dim = p.partition_dim
            return tuple(n * tp if d == dim else n for d, n in enumerate(shape))
        return tuple(shape)

    def cost(self, p):
        """Newton-Schulz FLOPs of p's matrices on a rank that orthogonalises them (--muon-tp-mode distributed:
        that rank's share)."""
        parts, _ = self._parts(p, torch.empty(p.shape, device="meta"))
        return sum(flops(*self._global_shape(p, t.shape), self.c.muon_num_ns_steps, self._shards(p, t.shape))
                   for t in parts)

    def _shards(self, p, shape):
        """Over how many ranks one matrix's Newton-Schulz work is split (--muon-tp-mode distributed)."""
        sharded = self._global_shape(p, shape) != tuple(shape) and self.c.muon_tp_mode == "distributed"
        return self.tp_size(p) if sharded else 1

    def orthogonalise(self, p, m):
        """The scaled orthogonalised update of one whole local weight m (p's shape)."""
        parts, grouped = self._parts(p, m)
        outs = [self._one(p, t) for t in parts]
        if grouped is None:
            return outs[0]
        return torch.cat([o.view(grouped[0], -1, m.shape[-1]) for o in outs], dim=1).view(m.shape)

    def _one(self, p, m):
        c = self.c
        tp, rank, group = tensor_parallel(p)
        rows, cols = self._global_shape(p, m.shape)
        scale = scale_factor(rows, cols, c.muon_scale_mode) * c.muon_extra_scale_factor
        steps, kind, prec = c.muon_num_ns_steps, c.muon_coefficient_type, c.muon_fp32_matmul_prec
        self.stats["matrices"] += 1
        self.stats["ns_flops"] += flops(rows, cols, steps, self._shards(p, m.shape))
        if (rows, cols) == tuple(m.shape):  # whole on this rank (or blockwise)
            return newton_schulz(m, steps, kind, prec) * scale
        dim, chunks = p.partition_dim, getattr(p, "shard_chunks", 1) if m.shape == p.shape else 1
        if c.muon_tp_mode == "distributed":
            return newton_schulz(m, steps, kind, prec, transpose=dim == 0, group=group) * scale
        shards = [torch.empty_like(m) for _ in range(tp)]
        comm.record_sent("muon_all_gather", m.numel() * m.element_size() * tp, m.numel() * m.element_size() * (tp - 1))
        dist.all_gather(shards, m.contiguous(), group=group)
        whole = _join(shards, dim, chunks)
        return _take(newton_schulz(whole, steps, kind, prec), dim, chunks, tp, rank) * scale

    # -- the step ---------------------------------------------------------------------------------------
    def group_updates(self, flat_groups, groups, held, flat_grads):
        """{id(muon flat group): its flat orthogonalised update}: each group's momentum (updates.py), then
        every matrix of the rank. held[i]: the model parameter behind main param i."""
        momenta = {}
        for grp in flat_groups:
            if grp.kind == "muon":
                group = groups[grp.group_index]
                u = updates.muon_momentum_(flat_grads[id(grp)], grp.states["momentum_buffer"], group["momentum"],
                                           group["nesterov"])
                momenta.update({held[i]: t for i, t in zip(grp.idx, u.split(grp.sizes))})
        orth = self.updates(momenta)
        return {id(grp): torch.cat([orth[held[i]] for i in grp.idx]) for grp in flat_groups if grp.kind == "muon"}

    def updates(self, u):
        """u: {param: this rank's momentum pieces (flat, its holding)} -> {param: the update's same
        pieces}. Collective over every sharding group, in the same order on every rank."""
        out = {}
        for h in self.holdings:
            if len(h.ranges) == 1:
                out[h.param] = self.orthogonalise(h.param, u[h.param].view(h.param.shape)).reshape(-1)
        for group, d, me, hs, owner in self.plans:
            self._exchange(group, d, me, hs, owner, u, out)
        return out

    def _exchange(self, group, d, me, hs, owner, u, out):
        dev = next(iter(u.values())).device if u else hs[0].param.device
        mine = [i for i, o in enumerate(owner) if o == me]
        size = [[h.ranges[r][1] - h.ranges[r][0] for r in range(d)] for h in hs]

        def empty():
            return torch.zeros(0, dtype=torch.float32, device=dev)
        send = [[u.get(hs[i].param, empty()) for i in range(len(hs)) if owner[i] == r] for r in range(d)]
        got = _all_to_all(send, [sum(size[i][r] for i in mine) for r in range(d)], group, me, dev)
        full = {}
        for r, flat in enumerate(got):  # pieces arrive in rank order: rank r's range follows rank r-1's
            for i, piece in zip(mine, flat.split([size[i][r] for i in mine])):
                full.setdefault(i, []).append(piece)
        result = {i: self.orthogonalise(hs[i].param, torch.cat(full[i]).view(hs[i].param.shape)).reshape(-1)
                  for i in mine}
        back = [[result[i][hs[i].ranges[r][0]:hs[i].ranges[r][1]] for i in mine] for r in range(d)]
        theirs = [[i for i in range(len(hs)) if owner[i] == r] for r in range(d)]
        got = _all_to_all(back, [sum(size[i][me] for i in theirs[r]) for r in range(d)], group, me, dev)
        for r, flat in enumerate(got):
            for i, piece in zip(theirs[r], flat.split([size[i][me] for i in theirs[r]])):
                if size[i][me]:
                    out[hs[i].param] = piece


def piece_ranges(offset, n, shard, d):
    """The param-local [start, end) each of the d ranks holds of a parameter at bucket offset `offset` (n
    elements) when rank r owns the bucket's [r * shard, (r + 1) * shard) (sharded_bucket.py's layout)."""
    return [(min(max(offset, r * shard), offset + n) - offset, min(max(offset, (r + 1) * shard), offset + n) - offset)
            for r in range(d)]


def balanced_owners(costs, d):
    """Greedy longest-first assignment of matrices (by cost) to d ranks: the same on every rank."""
    load, owner = [0] * d, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(d), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def _all_to_all(send, recv_sizes, group, me, dev):
    """send[r]: tensors for rank r (concatenated) -> the d flat tensors received, by source rank."""
    flat = [torch.cat(s) if s else torch.zeros(0, dtype=torch.float32, device=dev) for s in send]
    in_splits = [t.numel() for t in flat]
    out = torch.empty(sum(recv_sizes), dtype=torch.float32, device=dev)
    comm.record_sent("muon_all_to_all", sum(in_splits) * 4, (sum(in_splits) - in_splits[me]) * 4)
    dist.all_to_all_single(out, torch.cat(flat), recv_sizes, in_splits, group=group)
    return out.split(recv_sizes)


def _join(shards, dim, chunks):
    """The global matrix from TP shards along dim; with chunks > 1 (SwiGLU's [gate; up]) each shard is
    its slice of every stacked block."""
    if chunks == 1:
        return torch.cat(shards, dim=dim)
    return torch.cat([s.view(chunks, -1, s.shape[-1]) for s in shards], dim=1).reshape(-1, shards[0].shape[-1])


def _take(whole, dim, chunks, tp, rank):
    if chunks == 1:
        return whole.chunk(tp, dim=dim)[rank]
    blocks = whole.view(chunks, -1, whole.shape[-1])
    per = blocks.shape[1] // tp
    return blocks[:, rank * per:(rank + 1) * per].reshape(-1, whole.shape[-1])
