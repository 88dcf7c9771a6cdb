"""Every axis at once (issue 38, item 6): a DeepSeek-V3-shaped model (MLA with its q latent, norms and YaRN; one
dense first layer, then MoE with a shared expert, group-limited sigmoid routing with the expert bias and a
routed scaling factor; one MTP depth) on 8 ranks at TP2 + SP x CP2 x PP2 interleaved (the MTP layer with the loss
by `Et|t|t|mL`), its experts over EP2 inside each stage, ZeRO-3 and full recompute, in fp32 and in bf16:

- against one process (tests/support/parity.py: every gradient before clipping, norms, parameters after 6 steps, losses
  with the MTP loss; routing ties replayed; two samples per micro-batch). Worst errors over the three ATen
  capabilities (at one sample per micro-batch): parameters 3.5e-6
  (reference under avx2, ranks under default), gradients 1.7e-6; the MTP shift without its CP exchange gives 596
  mismatches;
- its checkpoint goes on for two steps at one process and at TP1 x DP4 with EP4 as the straight single-process run;
- the same in bf16 against one process in bf16, within BF16 at step 1 and the farthest rounding twin after
  (tests/support/parity_check.py); each routing choice of step 1 told by its token (decisions.about), later ones each
  run's own (tests/support/decision_replay.py);
- its checkpoint goes on for two steps at one process and at TP1 x DP4 with EP4 as the straight single-process run;
- exported as DeepseekV3ForCausalLM, transformers' logits equal megalite's.
"""


import pytest
import torch

from cli_batch import convert
from dist_util import rel_err, scratch_dir, start_on_ranks
from parity import DEEPSEEK, MB2, STEPS, layout, moe_collect, start_layouts, train
from parity_check import assert_parity

CKPT = scratch_dir("megalite-all-axes-")
MODEL = MB2 + DEEPSEEK + ("--moe-layer-freq", "[0,1,1]", "--num-layers", "3", "--mtp-num-layers", "1",
                    "--mtp-loss-scaling-factor", "0.3")  # the first layer dense, one MTP depth


def _all_axes(dtype, flags=()):
    return layout(f"tp2_sp_cp2_pp2_interleaved_ep2_zero3_recompute_{dtype}", tp=2, sp=True, cp=2, pp=2, zero=3,
                  recompute="full", model=MODEL, dtype=dtype,
                  flags=("--pipeline-model-parallel-layout", "Et|t|t|mL", "--expert-model-parallel-size", "2",
                         "--moe-token-dispatcher-type", "alltoall") + flags)


ALL_AXES = _all_axes("fp32", ("--save", CKPT))
# bf16 at step 1: TP's partial sums and the MoE combine are rounded to bf16 in another order, and CP's attention
# runs in fp32 where the single process's runs in bf16, so each activation and gradient differs by a few units
# of bf16's last place (2^-8 of the largest element) at each of the ~10 roundings along a layer's path: grads
# 4e-2 (10 ulps), the tied embedding's sums 1.6e-2 (4 ulps); the loss averages 128 tokens whose logits differ
# by ~2^-9 each: 2e-3 / sqrt(128) / 4.85 = 4e-5 at random signs, 1e-4 bound; the step-1 norm, a sum of squares
# of the grads, 1e-3. Measured over the three ATen capabilities: grads 1.8e-2, embedding 6.0e-3, loss 1.7e-5,
# norm 1.5e-4; later steps within the farthest rounding twin (parity_check.TWINS).
BF16 = {"losses@1": 1e-4, "norms@1": 1e-3, "grads": 4e-2, "embedding grads": 1.6e-2}
ALL_AXES_BF16 = _all_axes("bf16")
MORE = ("--train-iters", str(STEPS + 2), "--lr-decay-iters", str(STEPS))  # (constant LR) as the saved run


@pytest.fixture(scope="module")
def world():
    return dict(zip(("fp32", "bf16"), start_layouts([ALL_AXES, ALL_AXES_BF16], 8, moe_collect).result()))


def test_every_axis_at_once_matches_the_single_process(world):
    assert_parity(ALL_AXES, world["fp32"])


def test_every_axis_at_once_in_bf16_matches_the_single_process(world):
    assert_parity(ALL_AXES_BF16, world["bf16"], BF16)


def _continue_at_ep4():
    return train(layout("went_on_ep4", dp=4, zero=1, model=MODEL + MORE + ("--load", CKPT),
                        flags=("--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall")))


def test_its_checkpoint_goes_on_at_one_process_and_at_ep4(world):
    ep4 = start_on_ranks(_continue_at_ep4, 4)
    straight = train(layout("straight", model=MODEL + MORE))
    one = train(layout("went_on", model=MODEL + MORE + ("--load", CKPT)))
    names = set(straight["params"])
    assert any(n.startswith("mtp.layers.0.transformer_layer.mlp.experts") for n in names)
    runs = [("one process", one)] + [(f"TP1 x DP4 EP4 rank {r}", got) for r, got in enumerate(ep4.result())]
    for label, got in runs:
        losses = torch.tensor(got["losses"]), torch.tensor(straight["losses"][-2:])
        assert len(got["losses"]) == 2 and rel_err(*losses) <= 1e-5, (label, got["losses"], straight["losses"])
        assert set(got["params"]) <= names, label
        for n, p in got["params"].items():
            assert rel_err(p, straight["params"][n]) <= 1e-5, (label, n)
    assert set(one["params"]) == names == set().union(*(set(got["params"]) for _, got in runs[1:]))  # each expert


def test_exported_as_deepseek_v3_transformers_gives_its_logits(world, tmp_path):
    pytest.importorskip("transformers", reason="the HF conversion check needs transformers (the [test] extra)")
    from test_checkpoint_hf import _tokens, hf_logits, megalite_logits
    hf_dir = str(tmp_path / "hf")
    rc, _, err = convert("--loader", "megalite", "--saver", "hf", "--load-dir", CKPT, "--save-dir", hf_dir)
    assert rc == 0, err
    tokens = _tokens()
    model, ref = hf_logits(hf_dir, tokens)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert (megalite_logits(CKPT, tokens) - ref).abs().max().item() <= 1e-4
    # tools/generate.py builds the whole model from the checkpoint, not the layout's first stage
    from cli_batch import tool
    from megalite import parallel_state as ps
    try:
        model, _ = tool("generate").load_model(CKPT, 1)
        assert sorted(model.decoder.layers) == ["0", "1", "2"]  # (its MTP layer loaded, unused: labels None)
    finally:
        ps.destroy_model_parallel()
