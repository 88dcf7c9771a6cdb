"""MoE and multi-latent attention under context parallelism (issue 38, items 1 and 2) against the single process
(tests/support/parity.py: losses with
the aux and z losses, every gradient before clipping including routers and experts, grad norms, parameters
after 6 steps, DESIGN's fp32 bound; routing choices that are ties replayed, tests/support/decision_replay.py).

A CP rank's tokens are routed and dispatched like any other local tokens; what needs the whole micro-batch
sums over TP x CP: the aux losses' token counts and token totals (micro-batch and per sequence), sinkhorn's
column sums, the logged losses; the expert-bias counts sum over the stage (TP x CP x DP). The expert grid
spans TP x CP x DP inside a stage (EP ranks may sit on different CP ranks).

MLA: its queries and keys (nope + rope parts, YaRN positions by global token index) and values of
another head size go through every CP comm type: the ring paths carry V zero-padded to the query/key
head size (or Q/K padded to V's), a2a moves them apart. One spawn of 4 CPU ranks.
"""


import pytest

from parity import (MB2, MOE, MOE_BIAS, SINKHORN, layout, logged_by_reference, moe_collect, patched, record_logged,
                    reference, run_layouts)
from parity_check import assert_logged_as, assert_parity, mismatches

SEQ_AUX = MB2 + MOE + ("--moe-router-load-balancing-type", "seq_aux_loss")


def ep(n, kind="alltoall"):
    return ("--expert-model-parallel-size", str(n), "--moe-token-dispatcher-type", kind)


def counts_per_cp_chunk():
    """Fault: the aux losses' token counts summed over TP only (each CP chunk balanced on its own)."""
    from megalite.moe import router
    from megalite.tensor_parallel.mappings import all_reduce_sum_tp
    return patched(router, "all_reduce_sum_tp_cp", all_reduce_sum_tp)


LAYOUTS = [
    layout("moe_tp2_sp_cp2_p2p", tp=2, sp=True, cp=2, model=MB2 + MOE, fault=record_logged),
    layout("moe_tp2_sp_cp2_a2a_ep2_seq_aux", tp=2, sp=True, cp=2, cp_comm="a2a", model=SEQ_AUX,
           flags=ep(2), fault=record_logged),
    layout("moe_cp2_dp2_ep4_zero1_expert_bias", cp=2, dp=2, zero=1, model=MB2 + MOE + MOE_BIAS,
           flags=ep(4, "allgather")),
    # (one sample per micro-batch: sinkhorn's choices are replayed by their values, and two samples' tokens of one
    # symbol at one position are rows a rounding apart that may choose differently)
    layout("moe_cp2_dp2_ep2_sinkhorn", cp=2, dp=2, model=SINKHORN, flags=ep(2)),
]
# q from a latent (with its norm), YaRN with mscales; value heads smaller (10) or larger (16) than q/k's 8 + 4
MLA = MB2 + ("--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8",
       "--qk-pos-emb-head-dim", "4", "--qk-layernorm", "--normalization", "RMSNorm", "--rotary-scaling-factor", "4",
       "--mscale", "1.0", "--mscale-all-dim", "0.8", "--disable-bias-linear", "--untie-embeddings-and-output-weights")
LAYOUTS += [
    layout("mla_cp2_dp2_p2p_dv10", cp=2, dp=2, model=MLA + ("--v-head-dim", "10")),
    layout("mla_tp2_sp_cp2_a2a_dv16", tp=2, sp=True, cp=2, cp_comm="a2a", model=MLA + ("--v-head-dim", "16")),
    layout("mla_cp2_dp2_allgather_dv16_zero1", cp=2, dp=2, zero=1, cp_comm="allgather",
           model=MLA + ("--v-head-dim", "16")),
    layout("mla_moe_tp2_sp_cp2_p2p_ep2", tp=2, sp=True, cp=2, model=MLA + ("--v-head-dim", "10") + MOE,
           flags=ep(2)),
]
FAULTS = [layout("fault_seq_aux_per_cp_chunk", tp=2, sp=True, cp=2, model=SEQ_AUX, flags=ep(2),
                 fault=counts_per_cp_chunk)]


@pytest.fixture(scope="module")
def world():
    lays = LAYOUTS + FAULTS
    return dict(zip([lay.name for lay in lays], run_layouts(lays, 4, moe_collect)))


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.name)
def test_under_context_parallelism_matches_single_process(world, lay):
    assert_parity(lay, world[lay.name])


def test_expert_bias_counts_every_token_once_under_cp(world):
    """The routers' counts of a step: 8 sequences x 16 tokens x k = 2, summed over CP's halves and DP."""
    for r in world["moe_cp2_dp2_ep4_zero1_expert_bias"]:
        counts = r["collected"]["counts"]
        assert len(counts) == 4 and all(sum(c) == 8 * 16 * 2 for c in counts), counts


@pytest.mark.parametrize("name", ["moe_tp2_sp_cp2_p2p", "moe_tp2_sp_cp2_a2a_ep2_seq_aux"])
def test_logged_router_losses_are_the_single_processs_under_cp(world, name):
    lay = LAYOUTS[[x.name for x in LAYOUTS].index(name)]
    want = logged_by_reference(lay)
    assert len(want) == 6 and set(want[0]) == {"load_balancing_loss", "z_loss"}, want
    assert_logged_as(want, world[name], name)


@pytest.mark.parametrize("lay", FAULTS, ids=lambda lay: lay.name)
def test_faults_are_caught(world, lay):
    assert mismatches(lay, world[lay.name], reference(lay)), f"{lay.name} went unseen"


def test_dsa_under_context_parallelism_is_one_line():
    from megalite.cli.parser import check_args
    from megalite.config import ConfigError
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--train-iters", "1", "--lr", "1e-3", "--vocab-size", "64", "--context-parallel-size", "2",
            *MLA, "--v-head-dim", "12", "--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "2",
            "--dsa-indexer-head-dim", "8", "--dsa-indexer-topk", "4"]
    with pytest.raises(ConfigError) as e:
        check_args(argv, 2)
    assert "dsa with --context-parallel-size > 1 is not built" in str(e.value) and "\n" not in str(e.value)
