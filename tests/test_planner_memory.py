"""The planner's memory and traffic models (megalite/planner/memory.py, traffic.py) against what ranks keep
and send: for layouts over TP, PP (interleaved too), CP, EP, ZeRO-1/2/3, fp32 and bf16, AdamW, SGD, Lion and
Muon, every rank's
predicted weights + gradients + optimizer bytes equal, to the byte, what optimizer/memory.py's
training_state_bytes measures after a step, and its predicted data-parallel wire bytes per collective what
distributed/comm.py counted during that step. One spawn of 4 CPU ranks runs them all."""

import pytest

from dist_util import run_on_ranks
from parity import BASE, MOE, MOE_BIAS

ZERO = ("--use-distributed-optimizer", "--zero-stage")
LAYOUTS = {
    "dp4_fp32": (),
    "dp4_bf16": ("--bf16",),
    "tp2_sp_dp2_zero1_bf16": ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16") + ZERO + ("1",),
    "pp2_dp2_zero2_tied": ("--pipeline-model-parallel-size", "2") + ZERO + ("2",),
    "pp2_interleaved_zero1_bf16": ("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                                   "1", "--bf16") + ZERO + ("1",),
    "dp4_zero3_bf16": ("--bf16",) + ZERO + ("3",),
    "pp2_dp2_zero3_untied": ("--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights")
    + ZERO + ("3",),
    "cp2_dp2_zero1": ("--context-parallel-size", "2") + ZERO + ("1",),
    "ep2_dp4_zero1_moe_bias": MOE + MOE_BIAS + ("--expert-model-parallel-size", "2") + ZERO + ("1",),
    "tp2_sp_ep2_zero2_moe_bf16": MOE + ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                        "--expert-model-parallel-size", "2",
                                     "--expert-tensor-parallel-size", "1", "--bf16") + ZERO + ("2",),
    # per-replica micro-batch sizes: the ranks run 1, 1, 2, 2 micro-batches, so ZeRO-2 keeps full gradients and
    # reduces once (as ZeRO-1)
    "dp4_zero2_sizes_2_2_1_1": ZERO + ("2", "--data-parallel-micro-batch-sizes", "2,2,1,1"),
    # optimizer CPU offload: whole parameters from each group's front on the host (a fraction per replica too)
    "dp4_zero1_bf16_offload_half": ("--bf16",) + ZERO + ("1", "--optimizer-cpu-offload", "--optimizer-offload-fraction",
                                                         "0.5"),
    "tp2_sp_dp2_offload_0_0.7": ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--optimizer-cpu-offload",
                                 "--optimizer-offload-fraction", "0,0.7"),
    # a precision per replica: each rank's weights in its replica's dtype (fp32 replicas keep no second copy)
    "dp4_precisions_bf16_fp32_fp16_fp32": ("--data-parallel-precisions", "bf16,fp32,fp16,fp32"),
    "dp4_decoupled_lr_odd_bucket": ("--decoupled-lr", "1e-3", "--ddp-bucket-size", "1000") + ZERO + ("1",),
    # other optimizers' states; Muon's whole-matrix traffic (ZeRO all-to-alls, TP gathers) counted too
    "dp4_sgd_bf16": ("--optimizer", "sgd", "--bf16"),
    "tp2_sp_dp2_zero1_lion": ("--optimizer", "lion", "--tensor-model-parallel-size", "2", "--sequence-parallel")
    + ZERO + ("1",),
    "tp2_sp_dp2_zero2_muon_bf16": ("--optimizer", "muon", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--bf16", "--ddp-bucket-size", "2000") + ZERO + ("2",),
    "ep2_dp4_zero1_muon_lion": MOE + ("--optimizer", "muon", "--muon-scalar-optimizer", "lion",
                                      "--expert-model-parallel-size", "2") + ZERO + ("1",),
    # multi-token prediction: its layer, norms and eh_proj on the last stage, the embedding there too
    "pp2_dp2_mtp1_rope_zero1": ("--pipeline-model-parallel-size", "2", "--mtp-num-layers", "1",
                                "--position-embedding-type", "rope") + ZERO + ("1",),
}


def _measure_and_predict(layouts):
    import pretrain_gpt
    from megalite import parallel_state as ps
    from megalite.cli.parser import parse_args
    from megalite.config.plan import PlanConfig
    from megalite.optimizer.memory import state_bytes_by_place, training_state_bytes
    from megalite.distributed import comm
    from megalite.planner.memory import training_state
    from megalite.planner.traffic import dp_wire_bytes
    from megalite.training import pretrain
    from parity import learnable_datasets
    out = []
    for flags in layouts:
        args = parse_args(list(BASE) + list(flags) + ["--train-iters", "1"], world_size=ps.world_size())
        comm.reset()
        _, chunks, opt = pretrain(learnable_datasets, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args,
                                  return_state=True)
        g = ps._grid()  # this rank's coordinates, described without groups
        grid = ps.Grid.of(g.tp, g.pp, g.dp, g.cp, g.vpp, g.ep if g.experts else None, g.etp if g.experts else None,
                          g.tp_rank, g.pp_rank, g.dp_rank, g.cp_rank)
        plan = PlanConfig.of(args)  # (the planner's view of the same command line)
        mcfg = plan.model
        predicted = training_state(plan, mcfg, grid)
        m = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
        sent = {op: c["wire_bytes"] for op, c in comm.counts().items()}
        from megalite.planner.optimizer_step import muon_plan
        muon = getattr(opt, "_muon", None)
        out.append((training_state_bytes(chunks, opt), predicted.total, vars(predicted), sent,
                    dp_wire_bytes(plan, mcfg, grid, m), muon.stats["ns_flops"] if muon else 0,
                    muon_plan(plan, mcfg, grid)["flops"], state_bytes_by_place(chunks, opt)[1],
                    predicted.host + 4 * predicted.host_elements))
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def world():
    return run_on_ranks(_measure_and_predict, 4, list(LAYOUTS.values()), timeout=400)


@pytest.mark.parametrize("i", range(len(LAYOUTS)), ids=list(LAYOUTS))
def test_predicted_state_bytes_equal_the_measured(world, i):
    for rank, results in enumerate(world):
        measured, predicted, parts = results[i][:3]
        assert predicted == measured, f"rank {rank}: predicted {predicted} ({parts}) != measured {measured}"


@pytest.mark.parametrize("i", range(len(LAYOUTS)), ids=list(LAYOUTS))
def test_predicted_data_parallel_bytes_equal_the_counted(world, i):
    for rank, results in enumerate(world):
        sent, predicted = results[i][3:5]
        for op in set(sent) | {k for k, v in predicted.items() if v}:
            assert abs(sent.get(op, 0.0) - predicted.get(op, 0.0)) < 1e-6 * max(1.0, sent.get(op, 0.0)), \
                f"rank {rank} {op}: predicted {predicted.get(op, 0.0):.0f} wire bytes, counted {sent.get(op, 0.0):.0f}"


@pytest.mark.parametrize("i", [i for i, k in enumerate(LAYOUTS) if "muon" in k],
                         ids=[k for k in LAYOUTS if "muon" in k])
def test_predicted_newton_schulz_work_equals_the_done(world, i):
    """The Newton-Schulz FLOPs the planner gives each rank (its matrices by the same balanced assignment) are
    those the rank's Muon did in the step."""
    for rank, results in enumerate(world):
        done, predicted = results[i][5:7]
        assert done > 0 and predicted == done, f"rank {rank}: predicted {predicted} Newton-Schulz FLOPs, done {done}"


@pytest.mark.parametrize("i", [i for i, k in enumerate(LAYOUTS) if "offload" in k],
                         ids=[k for k in LAYOUTS if "offload" in k])
def test_predicted_host_bytes_equal_the_measured(world, i):
    """--optimizer-cpu-offload: the host part (fp32 main values, states, the gradients' host buffer) the planner
    gives each rank is what the rank's optimizer keeps on the host, to the byte."""
    for rank, results in enumerate(world):
        measured, predicted = results[i][7:]
        assert predicted == measured, f"rank {rank}: predicted {predicted} host bytes, measured {measured}"
    assert any(r[i][7] for r in world), "nothing was offloaded"
