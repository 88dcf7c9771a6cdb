"""ZeRO-style distributed optimizer (`--use-distributed-optimizer`, `--zero-stage {1,2}`).

Each DP rank owns a contiguous 1/d slice of every gradient bucket (the buckets are padded
so the d slices are equal; a parameter crossing a slice boundary is split into pieces, see
`megalite/distributed/sharded_bucket.py`). Gradients are reduce-scattered bucket by
bucket from the backward hooks; each rank keeps fp32 main parameters and Adam states for
its pieces only and steps them; the updated parameters are then all-gathered bucket by
bucket (with `--overlap-param-gather`, asynchronously: each module's forward waits for
its own buckets, so the gather overlaps the next forward).

Bytes per parameter per rank, Ψ parameters, d DP ranks (bf16 params; fp32 params in [ ]):
    plain optimizer        2 + 4 + 12       = 18        [4 + 4 + 8 = 16]
    ZeRO-1 (Megatron)      2 + 4 + 12/d     = 6 + 12/d  [8 + 8/d]
    ZeRO-2                 2 + 4/d + 12/d   = 2 + 16/d  [4 + 12/d]
(model params + fp32 grads + fp32 main params and Adam m, v; fp32 models step their own
parameters, so main params add nothing there). ZeRO-2 figures are at rest: during a
backward at most two buckets' full-size fp32 buffers are alive.

Trade-off of ZeRO-2: gradients are reduce-scattered every micro-batch instead of once per
iteration, so with M micro-batches a rank sends (d-1)/d·Ψ·(4M + param bytes) per
iteration instead of (d-1)/d·Ψ·(4 + param bytes) (ZeRO-1) or 2(d-1)/d·Ψ·4 (all-reduce);
in exchange the full fp32 gradient buffer (4 bytes/param) never persists. Worth it when
memory, not bandwidth, limits (large models, few micro-batches per iteration).

Grad-norm clipping sums squared norms over the owned slices (TP-duplicated parameters on
TP rank 0 only, the last stage's tied-embedding copy not at all), then over DP and over
TP x PP. The fp16 inf check is reduced over DP and TP x PP, so every rank skips together.
"""

import torch
import torch.distributed as dist

from megalite import mup, parallel_state as ps
from megalite.config import ConfigError
from megalite.optimizer.clip_grads import grad_norm_tensor
from megalite.optimizer.muon import Holding, is_muon_matrix, piece_ranges
from megalite.optimizer.optimizer import MixedPrecisionOptimizer


class DistributedOptimizer(MixedPrecisionOptimizer):
    def __init__(self, model_chunks, config):
        c = config
        self.config = c
        self.model_chunks = list(model_chunks)
        self.grid = ps.grid_of(self.model_chunks)
        self._mup_width = mup.width_mult(self.model_chunks)
        for m in self.model_chunks:
            if not getattr(m, "zero_stage", 0):
                raise ValueError("DistributedOptimizer needs DistributedDataParallel(..., "
                                 "use_distributed_optimizer=True)")
        names, self.model_params = {}, []
        for i, m in enumerate(self.model_chunks):
            prefix = f"chunk{i}." if len(self.model_chunks) > 1 else ""
            for n, p in m.module.named_parameters():
                if p.requires_grad:
                    names[p] = prefix + n
                    self.model_params.append(p)
        index = {p: i for i, p in enumerate(self.model_params)}
        low_precision = c.bf16 or c.fp16
        self.pieces, self.names = [], []
        for m in self.model_chunks:
            for b in m.buckets:
                for piece in b.pieces:
                    self.pieces.append(piece)
                    self.names.append(names[piece.param])
                    piece.index = index[piece.param]
        # Collective so that every rank fails together rather than one rank alone.
        empty = torch.tensor([0.0 if self.pieces else 1.0], device=ps.get_device())
        if dist.is_initialized():
            dist.all_reduce(empty, op=dist.ReduceOp.MAX)
        if empty.item():
            raise ConfigError("some data-parallel rank owns no parameter elements: use a smaller data-parallel "
                             "size (or a larger model)")
        # fp32 models step their own slices of the parameter buffer in place (no copy); the
        # flat buffers then hold exp_avg / exp_avg_sq of this rank's pieces, main params too otherwise.
        own = not low_precision and self.pieces[0].data.dtype == torch.float32
        self._build_groups([(n, pc.param, pc.data) for n, pc in zip(self.names, self.pieces)], own, movable=False)
        self.fp8_gather = None
        if getattr(getattr(self.model_chunks[0].module, "config", None), "fp8_param_gather", False):
            from megalite.distributed.fp8_gather import Fp8ParamGather
            self.fp8_gather = Fp8ParamGather(self.model_chunks, self.pieces, self.main_params, self.grid)

    def _holdings(self):
        """Muon's view: every Muon matrix of this rank's buckets with the range each rank of its bucket's
        sharding group holds (pieces lie back to back in rank order; the same on every rank)."""
        out = []
        for m in self.model_chunks:
            for b in m.buckets:
                offset, rank = 0, b.lo // b.shard
                for p in b.params:
                    n = p.numel()
                    if is_muon_matrix(p):
                        out.append(Holding(p, piece_ranges(offset, n, b.shard, b.dp), b.group, rank))
                    offset += n
        return out

    def _held(self):
        return [pc.param for pc in self.pieces]

    def _grads(self):
        return [pc.grad for pc in self.pieces]

    def _inf_groups(self):
        # Only the owner of a slice sees its inf: reduce over DP and TP x PP (= every rank).
        return (self.grid.dp_cp()[0], self.grid.mp_group)

    def _grad_norm(self, grads):
        return grad_norm_tensor([pc.param for pc in self.pieces], grads, sharded_over_dp=True)

    def _copies(self):
        return [pc.data for pc in self.pieces]

    def _after_step(self):
        self._publish()

    def _publish(self):
        """All-gather the buckets (the owned slices already hold the new values)."""
        if self.fp8_gather is not None:  # --fp8-param-gather: the FP8 weights quantized from the main weights
            self.fp8_gather.prepare()
        for m in self.model_chunks:
            m.start_param_sync()
            if not m.overlap_param_gather:
                m.finish_param_sync()

    # -- state: one shard per DP rank, each recording the elements it owns -------------
    def state_dict(self):
        shards = []
        for mp, pc, name in zip(self.main_params, self.pieces, self.names):
            st = self.optimizer.state.get(mp, {})
            entry = {"name": name, "index": pc.index, "shape": tuple(pc.param.shape), "start": pc.start,
                     "end": pc.end, "main_param": mp.detach().clone(),
                     "step": float(st["step"]) if "step" in st else 0.0, "keys": self.state_keys(mp)}
            for k in entry["keys"]:
                entry[k] = st[k].detach().clone() if k in st else torch.zeros_like(entry["main_param"])
            shards.append(entry)
        _, dp_size, dp_rank = self.grid.dp_cp()
        return {"format": "megalite-zero-shard", "dp_rank": dp_rank, "dp_size": dp_size,
                "scaler": self.scaler.state_dict(),
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "shards": shards}

    def load_state_dict(self, sd):
        """Load a shard saved under the same DP size; other sizes: reassemble_full_state()
        over all shards, then load_full_state()."""
        mine = [(e["name"], e["start"], e["end"]) for e in sd["shards"]]
        have = [(n, pc.start, pc.end) for n, pc in zip(self.names, self.pieces)]
        if mine != have:
            _, dp_size, dp_rank = self.grid.dp_cp()
            raise ValueError(f"optimizer shard from DP rank {sd['dp_rank']}/{sd['dp_size']} does not match this rank's "
                             f"slices (DP x CP {dp_rank}/{dp_size}); "
                             "re-shard with reassemble_full_state() + load_full_state()")
        self._load_entries(sd["shards"], sd)

    def load_full_state(self, full):
        """Take this rank's slices of full per-parameter states (reassemble_full_state)."""
        params = full["params"]
        missing = [n for n in self.names if n not in params]
        if missing:
            raise ValueError(f"full optimizer state lacks parameter {missing[0]!r}: it was saved from another model")
        sources = []
        for pc, name in zip(self.pieces, self.names):
            f = params[name]
            sources.append({"step": f["step"], **{k: f[k].reshape(-1)[pc.start:pc.end]
                                                  for k in ("main_param",) + tuple(f["keys"])}})
        self._load_entries(sources, full)

    @torch.no_grad()
    def _load_entries(self, sources, sd):
        for src, mp, pc in zip(sources, self.main_params, self.pieces):
            mp.copy_(src["main_param"])
            if mp is not pc.data:
                pc.data.copy_(mp)  # the owned slice of the model takes the loaded weights
            self.optimizer.state[mp] = {"step": torch.tensor(float(src["step"]), dtype=torch.float32),
                                        **{k: src[k] for k in self.state_keys(mp)}}
        for grp in self._flat:
            self._adopt_state(grp)  # copied into the flat buffers
        self.scaler.load_state_dict(sd["scaler"])
        # Groups by kind: a rank's slices may lack a kind another rank (whose groups were saved) has.
        def kind(g):
            return (g.get("optimizer", "adam"), g.get("decay", g["weight_decay"] > 0), g.get("decoupled", False),
                    g.get("mup_lr_mult", 1.0))
        saved = {kind(s): s for s in sd["param_groups"]}
        for g in self.param_groups:
            if kind(g) in saved:
                g.update(saved[kind(g)])
        self._publish()


def reassemble_full_state(shard_state_dicts):
    """Full fp32 per-parameter states from every DP rank's shard of one model-parallel rank:
    {"params": {name: {"main_param", "exp_avg", "exp_avg_sq" (full shape), "step"}}, ...}."""
    sizes = {sd["dp_size"] for sd in shard_state_dicts}
    ranks = sorted(sd["dp_rank"] for sd in shard_state_dicts)
    if len(sizes) != 1 or ranks != list(range(sizes.pop())):
        raise ValueError(f"need exactly one shard from each DP rank, got DP ranks {ranks}")
    params, covered = {}, {}
    for sd in shard_state_dicts:
        for e in sd["shards"]:
            n = e["name"]
            numel = int(torch.Size(e["shape"]).numel())
            keys = ("main_param",) + tuple(e.get("keys", ("exp_avg", "exp_avg_sq")))
            if n not in params:
                params[n] = {"shape": e["shape"], "step": e["step"], "index": e["index"], "keys": keys[1:],
                             **{k: torch.zeros(numel, dtype=torch.float32) for k in keys}}
                covered[n] = torch.zeros(numel, dtype=torch.int32)
            for k in keys:
                params[n][k][e["start"]:e["end"]] = e[k].float().cpu()
            covered[n][e["start"]:e["end"]] += 1
    for n, cov in covered.items():
        if not bool((cov == 1).all()):
            raise ValueError(f"optimizer shards cover parameter {n!r} {int(cov.min())} to {int(cov.max())} times; "
                             "pass every DP rank's shard exactly once")
        for k in ("main_param",) + params[n]["keys"]:
            params[n][k] = params[n][k].view(params[n]["shape"])
    first = shard_state_dicts[0]
    return {"params": params, "scaler": first["scaler"], "param_groups": first["param_groups"]}
