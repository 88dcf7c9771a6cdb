"""Tests of the tests: each fault a real bug would cause, injected alone inside the spawned
ranks, must make the parity harness (tests/support/parity.py) report a mismatch naming the tensor; the
semi-synchronous replicas' faults, their harness (tests/support/semi_sync_reference.py).

The faulty runs share one spawn of two ranks and one of eight.
"""

import contextlib

import pytest

from parity import EIGHT_LAYERS, LLAMA, MB2, layout, patched, reference, start_layouts
from parity_check import assert_parity, mismatches
from semi_sync_reference import DILOCO, collect, semi, semi_sync_mismatches, serial_reference


def no_dp_averaging():
    """The DP reduction sums instead of averaging (`data.div_(dp)` undone), plain and ZeRO buckets."""
    from megalite.distributed.grad_buffer import _Bucket
    from megalite.distributed.sharded_bucket import ShardedBucket
    plain, sharded = _Bucket.start, ShardedBucket.start

    def start_plain(self):
        if self.handle is None and self.dp > 1:
            self.data.mul_(self.dp)
        plain(self)

    def start_sharded(self):
        if self.pending() and self.dp > 1:
            self.data.mul_(self.dp)
        sharded(self)
    stack = contextlib.ExitStack()
    stack.enter_context(patched(_Bucket, "start", start_plain))
    stack.enter_context(patched(ShardedBucket, "start", start_sharded))
    return stack


def no_tied_embedding_sync():
    from megalite.distributed import finalize
    return patched(finalize, "allreduce_embedding_grads", lambda chunks: None)


def no_sequence_parallel_allreduce():
    from megalite.distributed import finalize
    return patched(finalize, "allreduce_sequence_parallel_grads", lambda params, grid=None: None)


def tp_duplicates_counted_tp_times():
    """Norms and row biases (identical on every TP rank) enter the grad norm TP times."""
    from megalite import parallel_state as ps
    from megalite.optimizer import clip_grads
    return patched(clip_grads, "counted_once",
                    lambda p: not (getattr(p, "shared_embedding", False)
                                   and not ps.is_pipeline_first_stage(ignore_virtual=True)))


def loss_not_divided_by_microbatches():
    from megalite.pipeline.run import Run
    original = Run.forward

    def forward(self, chunk, input_tensor):
        scale, self.loss_scale = self.loss_scale, self.loss_scale * self.divisor  # cancels the "/ m"
        try:
            return original(self, chunk, input_tensor)
        finally:
            self.loss_scale = scale
    return patched(Run, "forward", forward)


def last_microbatch_dropped():
    """The last stage's backward of each iteration's last micro-batch starts from a zero gradient (its loss is
    logged, its gradient never reaches the weights): a pipeline that skips a micro-batch."""
    import torch
    from megalite.pipeline.run import Run
    original = Run._backward

    def backward(self, chunk, input_tensor, output_tensor, output_grad):
        if output_grad is None and self.bwd_mb[chunk] == self.m - 1:
            output_grad = torch.zeros_like(output_tensor)
        return original(self, chunk, input_tensor, output_tensor, output_grad)
    return patched(Run, "_backward", backward)


def zero_shard_update_skipped():
    """DP rank 1 never applies Adam to the slice it owns (its all-gather publishes stale values)."""
    from megalite import parallel_state as ps
    from megalite.optimizer.distributed_optimizer import DistributedOptimizer
    original = DistributedOptimizer._update

    def update(self, grads, copies):
        if ps.get_data_parallel_rank() != 1:
            original(self, grads, copies)
    return patched(DistributedOptimizer, "_update", update)


def cp_lse_merge_dropped():
    """Ring attention adds the partial outputs instead of weighting them by their LSEs."""
    import torch
    from megalite.transformer import cp_attention
    return patched(cp_attention, "merge", lambda out, lse, o, lse_o: (out + o, torch.logaddexp(lse, lse_o)))


def cp_chunk_pairing_reversed():
    """Attention believes a rank holds chunks 2CP-1-r and r while the data gives it r and 2CP-1-r."""
    import torch
    from megalite.transformer import cp_attention

    def reversed_index(local_len, rank, size, device=None):
        c, a, b = local_len // 2, rank, 2 * size - 1 - rank
        return torch.cat([torch.arange(b * c, (b + 1) * c, device=device),
                          torch.arange(a * c, (a + 1) * c, device=device)])
    return patched(cp_attention, "local_token_index", reversed_index)


def cp_grads_not_reduced():
    """Gradients reduced over DP only, not DP x CP (each CP rank keeps its part of the sum)."""
    from megalite import parallel_state as ps
    from megalite.distributed.grad_buffer import _Bucket
    original = _Bucket.start

    def start(self):
        self.group = ps.get_data_parallel_group()
        original(self)
    return patched(_Bucket, "start", start)


def cp_grad_norm_counted_cp_times():
    """The grad norm sums the (replicated) gradients over the CP ranks too."""
    from megalite import parallel_state as ps
    from megalite.optimizer import optimizer
    original = optimizer.grad_norm_tensor
    return patched(optimizer, "grad_norm_tensor", lambda *a, **k: original(*a, **k) *
                    ps.get_context_parallel_world_size() ** 0.5)


def cp_local_positions():
    """Position ids and rope rows from each rank's local 0..s/CP-1 instead of the global ones."""
    import torch
    from megalite.models import gpt
    return patched(gpt, "global_token_index", lambda n, device=None, grid=None: torch.arange(n, device=device))


def shares_weighted_by_rank_means():
    """Uneven data-parallel shares averaged as per-rank means (each rank's loss over its own
    count, the reduction averaging): the small share is over-weighted."""
    from megalite.batching.iteration_plan import IterationPlan
    stack = contextlib.ExitStack()
    stack.enter_context(patched(IterationPlan, "loss_divisor",
                                lambda self, consumed, rank: self.counts(consumed)[rank]))
    stack.enter_context(patched(IterationPlan, "grad_divisor", property(lambda self: self.dp)))
    return stack


def microbatches_weighted_equally():
    """Micro-batches of unequal sizes weighted alike (each loss over the replica's micro-batch count
    instead of its samples / the micro-batch's size): the small micro-batches' samples are over-weighted."""
    from megalite.batching.iteration_plan import IterationPlan

    def total(self, consumed, rank=0):
        counts = self.counts(consumed)
        return sum(counts[r] for r in self.replica_ranks(rank))
    return patched(IterationPlan, "total", total)


def pseudo_gradient_sign_flipped():
    from megalite.distributed.semi_sync import SemiSync
    return patched(SemiSync, "_contribution", lambda self, local, glob: local - glob)


def outer_momentum_not_carried():
    from megalite.distributed.semi_sync import SemiSync
    original = SemiSync.outer_step

    def outer_step(self):
        self.buf = None  # every outer step starts a fresh momentum
        original(self)
    return patched(SemiSync, "outer_step", outer_step)


def replicas_weighted_equally():
    from megalite.distributed.semi_sync import SemiSync
    return patched(SemiSync, "_weight", lambda self, group, samples: 1.0 / self.replicas)


def fragment_synced_at_the_wrong_step():
    """Each fragment syncs where the next one should (fragment f at offset (f + 2) H / K)."""
    from megalite.distributed.semi_sync import SemiSync
    return patched(SemiSync, "offset", lambda self, f: ((f + 2) * self.round // self.fragments) % self.round)


# semi-synchronous faults (DiLoCo, two ranks): (fault, layout name, replicas, inner steps, streaming (fragments,
# delay, alpha), what the report must name)
SEMI_FAULTS = [
    (pseudo_gradient_sign_flipped, "dp2_r2_diloco", 2, "2", (1, 0, 0.0), "params"),
    (outer_momentum_not_carried, "dp2_r2_diloco", 2, "2", (1, 0, 0.0), "momentum"),
    (replicas_weighted_equally, "dp2_r2_uneven_3_1", 2, "3,1", (1, 0, 0.0), "params"),
    (fragment_synced_at_the_wrong_step, "dp2_r2_streaming_k2", 2, "4", (2, 1, 0.0), "params"),
]
SEMI_LAYOUTS = [semi(f"{f.__name__}@{name}", r, steps, dp=2, fault=f,
                     flags=("--semi-sync-fragments", str(k), "--semi-sync-fragment-delay", str(tau),
                            "--semi-sync-fragment-alpha", str(alpha)))
                for f, name, r, steps, (k, tau, alpha), _ in SEMI_FAULTS]


# (fault, layout name, layout, what the mismatch report must name): each fault on the smallest
# layout with its code path (two ranks; two samples per micro-batch where no pipeline needs more micro-batches,
# tests/support/parity.py's MB2), and again on an eight-rank layout of tests/test_parity.py
# (interleaving, ZeRO-2, SP, TP4, PP4), so those layouts are seen to fail too.
FAULTS = [
    (no_dp_averaging, "dp2", dict(dp=2, model=MB2), "step-1 grad"),
    (no_dp_averaging, "dp2_zero2", dict(dp=2, zero=2, model=MB2), "step-1 grad"),
    (no_tied_embedding_sync, "pp2", dict(pp=2), "embedding.word_embeddings.weight"),
    (no_sequence_parallel_allreduce, "tp2_sp", dict(tp=2, sp=True, model=MB2), "layernorm.weight: step-1 grad"),
    (tp_duplicates_counted_tp_times, "tp2", dict(tp=2, model=MB2), "norms"),
    (loss_not_divided_by_microbatches, "pp2", dict(pp=2), "step-1 grad"),
    (zero_shard_update_skipped, "dp2_zero1", dict(dp=2, zero=1, model=MB2), "param after"),
    (cp_lse_merge_dropped, "cp2", dict(cp=2, model=MB2), "step-1 grad"),
    (cp_chunk_pairing_reversed, "cp2", dict(cp=2, model=MB2), "step-1 grad"),
    (cp_grads_not_reduced, "cp2", dict(cp=2, model=MB2), "step-1 grad"),
    (cp_grad_norm_counted_cp_times, "cp2", dict(cp=2, model=MB2), "norms"),
    (cp_local_positions, "cp2_llama", dict(cp=2, model=MB2 + LLAMA), "step-1 grad"),
    (shares_weighted_by_rank_means, "dp2_shares_3_1", dict(dp=2, model=MB2, flags=("--data-parallel-shares", "3,1")),
     "step-1 grad"),
    (microbatches_weighted_equally, "dp2_sizes_4_1", dict(dp=2, flags=("--data-parallel-micro-batch-sizes", "4,1")),
     "step-1 grad"),
    (no_dp_averaging, "tp2_pp2_dp2_sp_interleaved_zero2", dict(tp=2, pp=2, dp=2, sp=True, vp=1, zero=2),
     "step-1 grad"),
    (no_tied_embedding_sync, "tp2_pp2_dp2_interleaved_zero1", dict(tp=2, pp=2, dp=2, vp=1, zero=1),
     "embedding.word_embeddings.weight"),
    (no_sequence_parallel_allreduce, "tp4_pp2_sp_llama", dict(tp=4, pp=2, sp=True, model=LLAMA),
     "layernorm.weight: step-1 grad"),
    (tp_duplicates_counted_tp_times, "tp2_pp2_dp2_sp", dict(tp=2, pp=2, dp=2, sp=True), "norms"),
    (loss_not_divided_by_microbatches, "pp4_dp2_interleaved_zero1",
     dict(pp=4, dp=2, vp=1, zero=1, model=EIGHT_LAYERS), "step-1 grad"),
    (zero_shard_update_skipped, "tp2_pp2_dp2_sp_zero2", dict(tp=2, pp=2, dp=2, sp=True, zero=2), "param after"),
    # half precision (tests/support/parity_check.py: step 1 exact on the reference's machine, later steps within the
    # farthest rounding twin): the same faults at step 1, and one that shows only in the later steps
    (no_tied_embedding_sync, "pp2_bf16", dict(pp=2, dtype="bf16"), "embedding.word_embeddings.weight"),
    (last_microbatch_dropped, "pp2_bf16", dict(pp=2, dtype="bf16"), "step-1 grad"),
    (last_microbatch_dropped, "pp2_fp16", dict(pp=2, dtype="fp16"), "step-1 grad"),
    (zero_shard_update_skipped, "dp2_zero1_bf16", dict(dp=2, zero=1, dtype="bf16"), "param after"),
    (zero_shard_update_skipped, "dp2_zero1_fp16", dict(dp=2, zero=1, dtype="fp16"), "param after"),
]
LAYOUTS = [layout(f"{f.__name__}@{name}", fault=f, **kw) for f, name, kw, _ in FAULTS]
EXPECTED = {lay.name: expected for lay, (*_, expected) in zip(LAYOUTS, FAULTS)}


@pytest.fixture(scope="module")
def faulty_runs():
    runs, started = {}, []
    for world in (2, 8):  # one spawn per world size runs all its faulty layouts; the two side by side
        lays = [lay for lay in LAYOUTS + SEMI_LAYOUTS if lay.world_size == world]
        started.append((lays, start_layouts(lays, world, collect=collect)))
    for lays, world in started:
        runs.update(zip((lay.name for lay in lays), world.result()))
    return runs


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.name)
def test_harness_reports_injected_fault(faulty_runs, lay):
    ranks = faulty_runs[lay.name]
    found = mismatches(lay, ranks, reference(lay))
    expected = EXPECTED[lay.name]
    named = [m for m in found if expected in m]
    print(f"\n{lay.name}: {len(found)} mismatches, e.g. {named[:1]}")
    assert named, f"{lay.name}: the harness did not name {expected!r} for this fault: {found}"
    with pytest.raises(AssertionError, match="mismatches against the single-process run"):
        assert_parity(lay, ranks)


@pytest.mark.parametrize("case", SEMI_FAULTS, ids=lambda c: f"{c[0].__name__}@{c[1]}")
def test_semi_sync_harness_reports_injected_fault(faulty_runs, case):
    fault, name, replicas, steps, streaming, expected = case
    lay = next(lay for lay in SEMI_LAYOUTS if lay.name == f"{fault.__name__}@{name}")
    steps = [int(h) for h in steps.split(",")] * (replicas if "," not in steps else 1)
    ref = serial_reference(lay, replicas, steps, DILOCO, 2, streaming)
    found = semi_sync_mismatches(lay, faulty_runs[lay.name], ref, steps, DILOCO)
    named = [m for m in found if f" {expected} " in m]
    print(f"\n{lay.name}: {len(found)} mismatches, e.g. {named[:1]}")
    assert named, f"{lay.name}: the semi-sync harness did not name {expected!r} for this fault: {found}"
