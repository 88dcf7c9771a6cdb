"""The kernels' race in a training run (megalite/training/kernel_choice.py; the race itself:
tests/kernels/test_kernel_choice.py): the classes the configuration names cover every class a run meets, and the
ranks of a world decide them once, alike, though each rank's own times would decide otherwise."""

import os

import pytest
import torch

import kernels
from dist_util import run_on_ranks
from kernels import _dispatch, choice, choice_cache, self_check, shape_class
from megalite import parallel_state as ps
from megalite.models import GPTModel
from megalite.tensor_parallel import model_parallel_manual_seed
from megalite.config.kernels import KernelConfig
from megalite.training.kernel_choice import decide_kernels, kernel_shapes
from model_util import batch, tiny_config


def _met(cfg, tp=1):
    """The classes a forward and backward of the GPT meets (each kernel asked, then sent down its fallback)."""
    met = set()

    def recording(kernel, ts, forced):
        met.add(shape_class.of(kernel, ts[0].shape, ts[0].dtype, ts[0].device))
        return False
    old = _dispatch._gate
    _dispatch.set_gate(recording)
    try:
        with kernels.use_backend("triton"):
            model_parallel_manual_seed(0)
            model = GPTModel(cfg)
            ids, labels = batch(cfg)
            model(ids, labels=labels).float().mean().backward()
    finally:
        _dispatch.set_gate(old)
    return met - {None}


def _named(cfg, tp=1):
    return {shape_class.of(*s) for s in kernel_shapes(cfg, 2, tp, 1, torch.device("cpu"))}


@pytest.mark.parametrize("flavour,extra", [("gpt2", {}), ("llama", {}), ("llama", {"qk_layernorm": True})])
def test_the_configuration_names_every_class_a_run_meets(grid, flavour, extra):
    cfg = tiny_config(flavour, num_layers=1, fused_kernels=True, params_dtype=torch.bfloat16, **extra)
    met, named = _met(cfg), _named(cfg)
    assert met and met <= named, (met - named, named)
    assert {c.kernel for c in met} == ({"layer_norm", "flash_attention", "bias_gelu", "cross_entropy"}
                                       if flavour == "gpt2" else
                                       {"rms_norm", "flash_attention", "rotary", "swiglu", "cross_entropy"})
    norms = {c for c in met if c.kernel in ("rms_norm", "layer_norm")}
    assert len(norms) == (3 if extra else 1), norms  # the hidden states'; q's and k's per head


# each rank's own times (ms: Triton, fallback): rank 0 finds every Triton path faster, rank 1 finds RMSNorm's and
# the loss's much slower; the sums decide RMSNorm and the loss for the fallback, the others for Triton
TIMES = {0: {}, 1: {"rms_norm": (4.0, 1.0), "cross_entropy": (3.0, 1.0), "swiglu": (1.5, 1.0)}}


def _world(cache):
    rank = torch.distributed.get_rank()
    choice.reset()
    self_check.set_self_check("off")
    os.environ[choice_cache.ENV] = f"{cache}/{rank}"  # each rank its own measurements
    choice.set_timer(lambda run, cls, backend: TIMES[rank].get(cls.kernel, (1.0, 2.0))[backend == "torch"])
    ps.initialize_model_parallel(2, 1)
    cfg = tiny_config("llama", num_layers=1, fused_kernels=True, sequence_parallel=True)
    met, named = _met(cfg, 2), _named(cfg, 2)
    assert met and met <= named, met - named
    kcfg = KernelConfig(kernel_choice="always", no_fused_kernels=False, no_kernel_self_check=True,
                        micro_batch_size=2, optimizer="adam", muon_scalar_optimizer=None)
    d = decide_kernels(kcfg, cfg, ps.current_grid())
    return sorted((c.label(), v) for c, v in d.items()), choice.summary()


def test_every_rank_takes_the_summed_decision(tmp_path):
    (d0, s0), (d1, s1) = run_on_ranks(_world, 2, str(tmp_path))
    assert d0 == d1 and s0 == s1, (d0, d1)
    assert dict((label.split()[0], v) for label, v in d0) == {
        "rms_norm": "torch", "cross_entropy": "torch", "swiglu": "triton", "flash_attention": "triton",
        "rotary": "triton", "adamw_step": "triton"}, d0
    assert "rms_norm torch 0.60x" in s0 and "swiglu triton 1.20x" in s0, s0


def test_no_fused_kernels_races_nothing():
    kcfg = KernelConfig(kernel_choice="torch", no_fused_kernels=True, no_kernel_self_check=True,
                        micro_batch_size=1, optimizer="adam", muon_scalar_optimizer=None)
    try:
        assert decide_kernels(kcfg, None, None) == {} and kernels.get_kernel_choice() == "torch"
    finally:
        kernels.set_kernel_choice("auto")
