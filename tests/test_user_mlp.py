"""docs/layers.md's "your own model" example runs as written on 2 ranks and equals a plain MLP."""

import pathlib
import re

import torch
import torch.nn.functional as F

from dist_util import rel_err, run_on_ranks
from model_util import gather_full

LAYERS_DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "layers.md"


def readme_example():
    text = LAYERS_DOC.read_text()
    m = re.search(r"<!-- tp-mlp-example -->\s*```python\n(.*?)```", text, re.S)
    assert m, "docs/layers.md lost its tensor-parallel MLP example"
    return m.group(1)


def _run(code):
    env = {}
    exec(compile(code, "docs/layers.md", "exec"), env)
    mlp, x, y = env["mlp"], env["x"], env["y"]
    w1, b1 = gather_full(mlp.up.weight, mlp.up.weight), gather_full(mlp.up.bias, mlp.up.bias)
    w2, b2 = mlp.down.weight, mlp.down.bias
    w2 = gather_full(w2, w2)
    params = [t.detach().double().requires_grad_(True) for t in (w1, b1, w2, b2)]
    ref = F.linear(F.gelu(F.linear(x.double(), params[0], params[1])), params[2], params[3])
    ref.sum().backward()
    grads = [gather_full(p, p.grad) for p in (mlp.up.weight, mlp.up.bias, mlp.down.weight)] + [mlp.down.bias.grad]
    return [rel_err(y.detach(), ref.detach())] + [rel_err(g, p.grad) for g, p in zip(grads, params)], \
        tuple(mlp.up.weight.shape)


def test_readme_tp_mlp_example():
    results = run_on_ranks(_run, 2, readme_example())
    for rank, (errs, shard_shape) in enumerate(results):
        assert shard_shape == (128, 64), f"rank {rank} should hold half of the 256 output features"
        assert max(errs) <= 1e-5, f"rank {rank}: output/grad relative errors {errs}"
