"""Every parameter of the model is created on the rank's device (the GPU under NCCL).

The CPU suite cannot see a CUDA device, so the device is redirected to "meta": a parameter
created anywhere else (e.g. the CPU) is caught here rather than on a GPU machine.
"""

import pytest
import torch

from megalite import parallel_state as ps
from megalite.models import GPTModel
from megalite.tensor_parallel import model_parallel_manual_seed
from model_util import tiny_config


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_all_parameters_on_the_rank_device(monkeypatch, flavour):
    monkeypatch.setattr(ps, "get_device", lambda: torch.device("meta"))
    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(0)
    try:
        model = GPTModel(tiny_config(flavour))
    finally:
        ps.destroy_model_parallel()
    wrong = [n for n, p in model.named_parameters() if p.device.type != "meta"]
    assert not wrong, f"parameters created off the rank's device: {wrong}"
