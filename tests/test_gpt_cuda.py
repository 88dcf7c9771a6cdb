"""On a GPU: the GPT with its Triton kernels (the default) against --no-fused-kernels, bf16,
at a small but GPU-valid shape, for the model flavours that take different kernel paths."""

import pytest
import torch

import kernels
from megalite import parallel_state as ps
from megalite.models import GPTModel
from megalite.tensor_parallel import model_parallel_manual_seed
from model_util import batch, tiny_config

pytestmark = pytest.mark.cuda

CASES = {
    "gpt2_bias_gelu": dict(),
    "gpt2_no_bias": dict(add_bias_linear=False),
    "llama_rope_swiglu_gqa": dict(),
    "gpt2_attention_dropout_softmax": dict(attention_dropout=0.1),
}


def _run(name, fused):
    flavour = "llama" if name.startswith("llama") else "gpt2"
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    try:
        cfg = tiny_config(flavour, hidden_size=512, num_attention_heads=4, seq_length=256, vocab_size=5000,
                          params_dtype=torch.bfloat16, fused_kernels=fused, **CASES[name])
        model = GPTModel(cfg)
        ids, labels = (t.cuda() for t in batch(cfg))
        torch.manual_seed(1)
        loss = model(ids, labels=labels).float().mean()
        loss.backward()
        return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("name", list(CASES))
def test_fused_model_matches_unfused_in_bf16(name):
    kernels.set_kernel_choice("triton")  # the Triton kernels themselves, not whichever path the race finds faster
    try:
        loss_f, grads_f = _run(name, True)
    finally:
        kernels.set_kernel_choice("auto")
    loss_u, grads_u = _run(name, False)
    if "dropout" in name:  # different dropout masks: only check it runs and is finite
        assert torch.isfinite(torch.tensor(loss_f))
        return
    # bf16 end to end: a few 1e-3 relative between two valid orders of rounding.
    assert abs(loss_f - loss_u) <= 1e-2 * abs(loss_u)
    for n in grads_u:
        err = (grads_f[n] - grads_u[n]).abs().max() / grads_u[n].abs().max().clamp_min(1e-12)
        assert err <= 5e-2, f"{name}: grad of {n} differs by {err:.3g}"
