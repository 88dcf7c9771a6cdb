"""Data-parallel gradient reduction through one contiguous fp32 buffer split into buckets.

Each parameter's `main_grad` is a view into the buffer. A hook runs when autograd has
accumulated a parameter's gradient: it adds it into `main_grad` and, once every parameter
of a bucket is ready on the last micro-batch, starts that bucket's asynchronous all-reduce
over the DP group, so communication overlaps the rest of the backward pass.
Buckets are filled in reverse parameter order, which is roughly the order in which
backward produces gradients.

With `use_distributed_optimizer=True` (ZeRO, see megalite/optimizer/distributed_optimizer.py)
the buckets are padded to a multiple of the DP size and reduce-scattered instead
(`sharded_bucket.py`); the parameters move into a flat buffer of the same layout so the
optimizer's updated shards can be all-gathered in place. Stage 3 plans one bucket per unit
(a transformer layer, the embedding, ...) and shards the parameters too (`param_units.py`).
"""

import contextlib
import weakref

import torch
from torch import nn

from megalite import parallel_state as ps
from megalite.config.ddp import DistributedDataParallelConfig
from megalite.distributed import comm
from megalite.distributed.param_facts import data_parallel, is_expert, stamp
from megalite.distributed.param_units import ParamUnits, Unit, plan_units
from megalite.distributed.sharded_bucket import ShardedBucket, adopt
from megalite.tensor_parallel.init import materialize


class _Bucket:
    """A bucket all-reduced (averaged) over DP: every rank holds the full result.
    nodes (--hierarchical-grad-reduce, the grid's grad_nodes): the all-reduce runs as a
    reduce-scatter among the ranks of a node, an all-reduce of each shard across the nodes
    (1/k of the bucket crosses nodes, k ranks per node) and an all-gather within the node."""
    reduce_every_microbatch = False
    wire_dtype = None  # --grad-reduce-in-bf16: what the all-reduce sends (the fp32 bucket rounded to it)

    def __init__(self, params, data, dp, group, divisor, nodes=None, compressor=None):
        self.params, self.data, self.dp, self.group, self.divisor = params, data, dp, group, divisor
        self.nodes, self.shard, self.compressor, self.wire = nodes, None, compressor, None
        self.ready, self.handle = set(), None
        offset = 0
        for p in params:
            p.main_grad = data[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()

    def accumulate(self, p):
        p.main_grad.add_(p.grad)

    def start(self):
        if self.handle is not None:
            return
        if self.divisor > 1:  # average over DP, as Megatron (summed over CP); also where an expert
            self.data.div_(self.divisor)  # group is one rank (EP = DP: nothing to reduce, still averaged)
        if self.dp == 1:
            self.handle = True
            return
        if self.compressor is not None and self.compressor.active:
            self.handle = "compress"  # --grad-compression: its collectives run in finish()
        elif self.nodes is not None:
            self.shard = torch.empty(self.data.numel() // len(self.nodes[1]), dtype=self.data.dtype,
                                     device=self.data.device)
            self.handle = comm.reduce_scatter(self.shard, self.data, group=self.nodes[0], async_op=True)
        elif self.wire_dtype is not None:
            self.wire = self.data.to(self.wire_dtype)
            self.handle = comm.all_reduce(self.wire, group=self.group, async_op=True)
        else:
            self.handle = comm.all_reduce(self.data, group=self.group, async_op=True)

    def finish(self):
        if self.handle == "compress":
            self.handle = True
            self.compressor.reduce(self)
        elif self.handle is not None and self.handle is not True:
            self.handle.wait()
            self.handle = True
            if self.wire is not None:
                self.data.copy_(self.wire)  # (the sum, back in the fp32 buffer)
                self.wire = None
            if self.nodes is not None:  # the node's shard summed over the nodes, then shared in the node
                if len(self.nodes[3]) > 1:
                    comm.all_reduce(self.shard, group=self.nodes[2])
                comm.all_gather(self.data, self.shard, group=self.nodes[0])
                self.shard = None

    def zero(self):
        self.data.zero_()
        self.ready.clear()
        self.handle = None


def plan_buckets(params, bucket_size, pad_to=1, isolate=None):
    """[(params, padded numel)] in reverse parameter order; a bucket closes once it holds
    bucket_size elements and is padded to a multiple of pad_to; `isolate` gets its own."""
    plan, current, size = [], [], 0
    for p in reversed(params):
        if p is isolate and current:
            plan.append((current, size))
            current, size = [], 0
        current.append(p)
        size += p.numel()
        if size >= bucket_size or p is isolate:
            plan.append((current, size))
            current, size = [], 0
    if current:
        plan.append((current, size))
    return [(ps_, -(-n // pad_to) * pad_to) for ps_, n in plan]


def tied_weight(module, pp):
    """Word embeddings with copies on the first and last pipeline stages are summed over them; alone in
    a bucket they get the same shard ranges on both stages, so owned shards can be summed."""
    if pp > 1 and getattr(module, "shares_embedding_across_stages", False):
        return module.shared_embedding_or_output_weight()
    return None


def plan_reduction(module, params, bucket_size, zero_stage, group_of, expert, nodes=None, tied=None, units=None):
    """[(bucket params, padded numel, (group, size, rank))]: the buckets per reduce group (dense, expert:
    group_of(p)), padded to the group size for ZeRO (to the node size for --hierarchical-grad-reduce's dense
    ones); ZeRO-3 one bucket per unit (units: plan_units(module)) and group, in backward order. A pure plan:
    the planner (megalite/planner/memory.py) prices the same buckets a rank builds."""
    def groups(ps_, size):
        out = []
        for is_expert_ in (False, True):
            mine = [p for p in ps_ if expert(p) == is_expert_]
            if not mine:
                continue
            group = group_of(mine[0])
            pad = group[1] if zero_stage else len(nodes[1]) if nodes and not is_expert_ else 1
            out += [(b, n, group) for b, n in plan_buckets(mine, size, pad, tied)]
        return out
    if zero_stage == 3:
        plan = []
        for _, _, own, _ in reversed(units or plan_units(module)):
            plan += groups(own, float("inf"))
        return plan
    return groups(params, bucket_size)


class _WaitFor:
    """Forward pre-hook: wait for these buckets' parameter all-gathers (returns None, so
    the module's inputs are left alone)."""

    def __init__(self, buckets):
        self.buckets = buckets

    def __call__(self, module, args):
        for b in self.buckets:
            b.finish_param_gather()


def _weak_hook(ddp):
    ref = weakref.ref(ddp)

    def hook(p):
        ddp = ref()
        if ddp is not None:
            ddp._hook(p)
    return hook


class DistributedDataParallel(nn.Module):
    def __init__(self, module, ddp_config=None, *, grad_divisor=None, reduce_once=False, compressor=None,
                 grid=None):
        """ddp_config: how it reduces and shards (megalite/config/ddp.py; default its defaults).
        grad_divisor: what the reduction divides the summed gradients by (default DP: the
        average; 1 with uneven data-parallel shares, whose losses carry the weights).
        reduce_once: ZeRO-2 reduces once per iteration too (ranks that run different numbers
        of micro-batches must issue the same collectives). compressor: --grad-compression's
        (megalite/distributed/grad_compression.py) for the plain DP all-reduce. grid: the module's (its `grid`;
        default the global one); each parameter's facts are set in it here, once (param_facts.stamp)."""
        super().__init__()
        cfg = self.ddp_config = ddp_config or DistributedDataParallelConfig()
        use_distributed_optimizer, zero_stage = cfg.use_distributed_optimizer, cfg.zero_stage
        self.module = module
        self.grid = grid = ps.current_grid(grid if grid is not None else getattr(module, "grid", None))
        self.overlap_grad_reduce = cfg.overlap_grad_reduce
        self.sync_enabled = True
        # Gradients reduce (and ZeRO shards) over DP x CP; CP ranks hold parts of one sequence,
        # so their gradients are parts of one sum: averaged over DP only.
        self.dp_group, self.dp, _ = grid.dp_cp()
        self.grad_divisor = grid.dp if grad_divisor is None else grad_divisor
        self.compressor = compressor
        if use_distributed_optimizer and zero_stage not in (1, 2, 3):
            raise ValueError(f"--zero-stage {zero_stage} is not supported; use 1, 2 or 3")
        self.zero_stage = zero_stage if use_distributed_optimizer else 0
        if self.zero_stage == 3 and reduce_once:  # a rank with fewer micro-batches would gather fewer times
            raise ValueError("ZeRO-3 needs the same micro-batch count on every data-parallel rank (no uneven shares)")
        # ZeRO-3 gathers unit by unit as the forward reaches them (with prefetch): always overlapped.
        self.overlap_param_gather = cfg.overlap_param_gather and self.zero_stage in (1, 2)
        params = [p for p in module.parameters() if p.requires_grad]
        stamp(module.parameters(), grid)
        device = params[0].device if params else torch.device("cpu")
        if device.type == "meta":  # built in ps.meta_init(): ZeRO-3 makes this rank's shards
            device = ps.get_device()
            if not (use_distributed_optimizer and zero_stage == 3):
                raise ValueError("a model built on the meta device needs ZeRO-3 (--zero-stage 3)")
        nodes = grid.grad_nodes if cfg.hierarchical and not self.zero_stage and self.dp > 1 else None
        tied = tied_weight(module, grid.pp) if self.zero_stage else None
        units = plan_units(module) if self.zero_stage == 3 else None
        plan = plan_reduction(module, params, cfg.bucket_size, self.zero_stage, data_parallel, is_expert, nodes, tied,
                              units)
        total = sum(n for _, n, _ in plan)
        # (ZeRO-2/3 buckets allocate their full-size gradients only while a reduction needs them)
        self.grad_data = torch.zeros(total, dtype=torch.float32, device=device) if self.zero_stage < 2 else None
        self.buckets, self._bucket_of = [], {}
        if self.zero_stage:
            dtypes = {p.dtype for p in params}
            if len(dtypes) > 1:
                raise ValueError(f"the distributed optimizer needs one parameter dtype, got {sorted(map(str, dtypes))}")
            # (an empty chunk of a pipeline layout has no parameters, so no dtype)
            dtype = next(iter(dtypes), torch.float32)
            # ZeRO-3: a buffer per bucket, as each unit's storage is freed on its own
            self.param_data = torch.zeros(total, dtype=dtype, device=device) if self.zero_stage < 3 else None
        offset = 0
        for bucket_params, n, (group, size, rank) in plan:
            grad = self.grad_data[offset:offset + n] if self.grad_data is not None else None
            dense = group is self.dp_group
            if self.zero_stage:
                flat = self.param_data[offset:offset + n] if self.param_data is not None else \
                    torch.zeros(n, dtype=dtype, device=device)
                b = ShardedBucket(bucket_params, n, self.zero_stage, grad, flat, size, rank, group, self.grad_divisor)
                b.reduce_every_microbatch = b.reduce_every_microbatch and not reduce_once
            else:
                b = _Bucket(bucket_params, grad, size, group, self.grad_divisor, nodes if dense else None,
                            compressor if dense else None)
            b.index = len(self.buckets)
            b.wire_dtype = torch.bfloat16 if cfg.grad_reduce_in_bf16 else None
            self.buckets.append(b)
            for p in bucket_params:
                self._bucket_of[p] = b
            offset += n
        for p in module.parameters():
            if p.is_meta:  # not sharded (frozen): whole on every rank
                adopt(p, materialize(p, 0, p.numel(), device).view(p.shape).to(p.dtype))
        self.units = None
        if self.zero_stage == 3:
            owner = {p: b for b in self.buckets for p in b.params}
            self.units = ParamUnits([Unit(name, mod, list({id(owner[p]): owner[p] for p in own + used}.values()))
                                     for name, mod, own, used in units], cfg.prefetch,
                                     cfg.reshard_after_forward)
        # through a weak reference: a parameter's hook is held in C++, where the garbage collector cannot see
        # it, so a hook holding this module would keep the model and its process groups alive for good
        hook = _weak_hook(self)
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in params]
        if self.overlap_param_gather:
            self._register_param_wait_hooks()

    def _hook(self, p):
        b = self._bucket_of[p]
        b.accumulate(p)
        p.grad = None
        if self.units is not None:
            self.units.backward_done(b, p)
        # ZeRO-2 reduces every micro-batch: gradients are never kept at full size.
        if b.reduce_every_microbatch or (self.sync_enabled and self.overlap_grad_reduce):
            b.ready.add(p)
            if len(b.ready) == len(b.params):
                self._start(b)

    def _start(self, b):
        b.start()
        if b.reduce_every_microbatch:
            # At most two buckets in flight, so at most two full-size buffers are alive.
            if b.index > 0:
                self.buckets[b.index - 1].finish()

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
            b.start()
        for b in self.buckets:
            b.finish()
        if self.units is not None:
            self.units.release_all()  # units whose parameters got no gradient (unused, tied)

    def reduced_grads(self):
        """After finish_grad_sync: per bucket, (the reduced fp32 gradient this rank holds, what the reduction
        divided it by) — the whole bucket, or with ZeRO this rank's shard of it. Fault-tolerant replicas sum
        these with the same rank of the other replicas (HSDP-style: a shard meets only its counterparts)."""
        for b in self.buckets:
            if isinstance(b, ShardedBucket):
                yield (b.data[b.lo:b.hi] if b.stage == 1 else b.shard_acc), b.divisor
            else:
                yield b.data, b.divisor

    def zero_grad_buffer(self, iteration=None):
        """Before an iteration (its number: when --grad-compression starts)."""
        for b in self.buckets:
            b.zero()
        if iteration is not None and self.compressor is not None:
            self.compressor.iteration = iteration

    # -- ZeRO: parameters all-gathered after the optimizer step ---------------------------
    def start_param_sync(self):
        """All-gather the updated parameter shards, first layers' buckets first (ZeRO-3: free
        the stale gathered copies; each unit is gathered when next used)."""
        if self.units is not None:
            self.units.release_all()
            return
        for b in reversed(self.buckets):
            b.start_param_gather()

    def finish_param_sync(self):
        for b in self.buckets:
            if self.zero_stage:
                b.finish_param_gather()

    def _register_param_wait_hooks(self):
        """--overlap-param-gather: a module waits for its own parameters' buckets only."""
        for mod in self.module.modules():
            buckets = {self._bucket_of[p] for p in mod.parameters(recurse=False) if p in self._bucket_of}
            if buckets:
                mod.register_forward_pre_hook(_WaitFor([b for b in self.buckets if b in buckets]))

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if self.units is not None:
            self.units.after_forward()  # prefetched but unused units are freed
        elif self.zero_stage:
            self.finish_param_sync()  # gathers whose modules did not run are not left in flight
        return out

    @contextlib.contextmanager
    def gathered(self):
        """Every parameter whole for the block's duration (ZeRO-3; others always are): for
        callers outside a training step that read weights directly (state_dict, tests)."""
        if self.units is None:
            self.finish_param_sync()
            yield
            return
        stats = dict(self.units.stats)  # the training schedule's figures, not this
        for u in self.units.units:
            self.units.ensure(u)
        try:
            yield
        finally:
            self.units.release_all()
            self.units.stats = stats

    def state_dict(self, *args, **kwargs):
        with self.gathered():
            sd = super().state_dict(*args, **kwargs)
            return {k: v.clone() for k, v in sd.items()} if self.units is not None else sd
