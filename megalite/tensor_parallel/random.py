"""RNG streams for tensor parallelism and activation recomputation.

Two streams, as in Megatron-LM:
- the default torch generator, seeded identically on every TP rank, for dropout on
  activations that are replicated across TP (so every rank drops the same elements);
- the tracked 'model-parallel-rng' stream, seeded differently per TP rank, for dropout on
  activations that are split across TP (attention probabilities of this rank's heads,
  sequence-parallel slices), entered with `get_rng_tracker().fork()`.
`checkpoint` recomputes a function in backward with both streams restored, so dropout
masks in the recomputation equal those of the forward. `get_rng_states` / `set_rng_states` are every random stream
of the process at once (Python's, NumPy's, torch's, the tracker's): the one API that a re-run, a healed replica,
a profiling pass and a checkpoint (megalite/checkpoint/state.py: the same as JSON) keep and restore them through.
"""

import contextlib
import random

import numpy as np
import torch

from megalite import parallel_state as ps

_MODEL_PARALLEL_RNG = "model-parallel-rng"


def _on_cuda():
    return ps.get_device().type == "cuda" if ps.model_parallel_is_initialized() else False


def _get_state():
    return torch.cuda.get_rng_state() if _on_cuda() else torch.get_rng_state()


def _set_state(state):
    if _on_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states that can be swapped in around a block of code."""

    def __init__(self):
        self.states = {}

    def reset(self):
        self.states = {}

    def get_states(self):
        return dict(self.states)

    def set_states(self, states):
        self.states = dict(states)

    def add(self, name, seed):
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _get_state()
        if _on_cuda():
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(saved)

    @contextlib.contextmanager
    def fork(self, name=_MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added: call model_parallel_manual_seed(seed) first")
        saved = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(saved)


_TRACKER = RNGStatesTracker()  # one per process, as Megatron's: the streams of the process's torch generators


def get_rng_tracker():
    return _TRACKER


def get_rng_states():
    """Every random stream of this process, in memory: {"python", "numpy", "torch", "cuda" (one per device, [] on
    CPU), "tracker" (the named states)}."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "tracker": _TRACKER.get_states()}


def set_rng_states(states):
    """Every random stream back to `states` (get_rng_states'); CUDA's where the states have them."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if torch.cuda.is_available() and states["cuda"]:
        torch.cuda.set_rng_state_all(states["cuda"])
    _TRACKER.set_states(states["tracker"])


def model_parallel_manual_seed(seed, grid=None):
    """Seed both streams: default identical across TP (and CP), tracked one distinct per TP
    (and CP) rank of `grid` (default the global one).

    Pipeline stages get distinct default seeds (their layers differ anyway).
    """
    g = ps.current_grid(grid)
    tp_rank, pp_rank = g.tp_rank, g.pp_rank
    # CP ranks attend to different tokens: each draws its own attention-dropout stream
    tracked_rank = tp_rank + g.tp * g.cp_rank
    default_seed = seed + 100 * pp_rank
    torch.manual_seed(default_seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(default_seed)
    _TRACKER.reset()
    _TRACKER.add(_MODEL_PARALLEL_RNG, default_seed + 2718 + tracked_rank)


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, wgrad_store, *args):
        ctx.run_function, ctx.wgrad_store = run_function, wgrad_store
        ctx.fwd_rng = _get_state()
        ctx.fwd_tracker = _TRACKER.get_states()
        with torch.no_grad():
            outputs = run_function(*args)
        tensors = [a if torch.is_tensor(a) else None for a in args]
        ctx.non_tensors = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[t for t in tensors if t is not None])
        ctx.is_tensor = [t is not None for t in tensors]
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        inputs = []  # the forward's inputs again, detached
        for is_t, nt in zip(ctx.is_tensor, ctx.non_tensors):
            if is_t:
                t = next(saved)
                d = t.detach()
                d.requires_grad_(t.requires_grad)
                inputs.append(d)
            else:
                inputs.append(nt)
        # Recompute under the forward's RNG states, then put the current ones back.
        cur_rng, cur_tracker = _get_state(), _TRACKER.get_states()
        _set_state(ctx.fwd_rng)
        _TRACKER.set_states(ctx.fwd_tracker)
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        finally:
            _set_state(cur_rng)
            _TRACKER.set_states(cur_tracker)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        store = ctx.wgrad_store
        if store is not None and store.key is not None:  # a split backward's B (zero-bubble pipelines)
            return (None, None) + _split_backward(store, inputs, pairs)
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(a.grad if torch.is_tensor(a) else None for a in inputs)


def _split_backward(store, inputs, pairs):
    """The recomputed region's backward inside a split backward's B: its inputs' gradients returned; its own
    parameters' gradients (norms, biases: the linear layers defer theirs already) handed to the store rather than
    accumulated, so that they accumulate at W with the rest, where the DP reduction fires (megalite/pipeline/
    run.py)."""
    outputs = [o for o, _ in pairs]
    wanted = [a for a in inputs if torch.is_tensor(a) and a.requires_grad]
    params = [p for p in _graph_leaves(outputs) if not any(p is a for a in wanted)]
    got = torch.autograd.grad(outputs, wanted + params, [g for _, g in pairs], allow_unused=True)
    for p, g in zip(params, got[len(wanted):]):
        if g is not None:
            store.put(lambda p=p, g=g: (p, g))
    given = iter(got[:len(wanted)])
    return tuple(next(given) if torch.is_tensor(a) and a.requires_grad else None for a in inputs)


def _graph_leaves(outputs):
    """The leaf tensors that take gradients in the autograd graph behind `outputs` (each once)."""
    nodes, seen, leaves = [o.grad_fn for o in outputs], set(), {}
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # (an AccumulateGrad node: its leaf)
            leaves[id(node.variable)] = node.variable
        nodes.extend(n for n, _ in node.next_functions)
    return list(leaves.values())


def checkpoint(function, *args, wgrad_store=None):
    """Run `function(*args)` without keeping its activations; recompute them in backward. wgrad_store: the split
    backward's (megalite/pipeline/wgrad.py) when the region holds parameters; during its B their gradients go
    there, not into .grad."""
    return _CheckpointFunction.apply(function, wgrad_store, *args)
