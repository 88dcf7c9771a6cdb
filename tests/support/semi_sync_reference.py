"""The semi-synchronous replicas' reference (tests/test_semi_sync.py, tests/test_fault_injection.py):
a single process runs the replicas' inner loops one after the other on model copies of megalite's own
single-process training, then applies the outer step with torch.optim.SGD on an fp32 global copy (Local
SGD: the sample-weighted mean of the weights); `semi_sync_mismatches` compares a world's ranks with it."""

import contextlib
import importlib

import torch

import parity
from dist_util import rel_err
from megalite import parallel_state as ps
from megalite.cli.parser import parse_args
from model_util import gather_full
from parity import STEPS, learnable_datasets

DILOCO = ("--semi-sync-method", "diloco", "--outer-lr", "0.7", "--outer-momentum", "0.9")
LOCAL_SGD = ("--semi-sync-method", "local_sgd")
EP2 = ("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall")  # (with parity.MOE)


def semi(name, replicas, steps, method=DILOCO, **kw):
    """A parity layout with R replicas of H (or H0,H1,...) inner steps per round."""
    flags = tuple(method) + ("--semi-sync-replicas", str(replicas), "--semi-sync-steps", steps)
    flags += tuple(kw.pop("flags", ()))
    return parity.layout(name, flags=flags, **kw)


def collect(chunks, opt):
    """A rank's replica and the outer momentum it holds, as full tensors under global names ({} for a run
    without replicas)."""
    s = getattr(opt, "semi_sync", None)
    if s is None:
        return {}
    elements = [sum(m.numel() for m, f in zip(opt.main_params, s.frag_of) if f == k) for k in range(s.fragments)]
    out = {"replica": ps.get_replica_rank(), "momentum": {}, "outer steps": s.outer_steps, "bytes": s.bytes_sent,
           "syncs": list(s.frag_syncs), "elements": elements, "round": s.round}
    if s.buf is not None:
        local = parity._full_local_grads(opt, s.buf)
        for name, p in parity._named(chunks):
            if id(p) in local:
                out["momentum"][name] = parity._cut_vocab(name, gather_full(p, local[id(p)]), parity.VOCAB)
    return out


class ReplicaView:
    """Replica r's samples in the order its inner loop reads them: of every chunk of micro x DP samples
    (Megatron's sampler) the DP ranks of block r take the contiguous run [r m n, (r+1) m n) (n = inner DP).
    With a micro-batch size per DP rank (contiguous slices of each global batch, megalite/batching/iteration_plan.py)
    pass micro = the global batch / DP: of every global batch block r takes its R-th part in order."""

    def __init__(self, base, r, replicas, dp, micro):
        self.base, self.r, self.n, self.dp, self.m = base, r, dp // replicas, dp, micro

    def __len__(self):
        return len(self.base) * self.n // self.dp

    def __getitem__(self, k):
        chunk, off = divmod(k, self.m * self.n)
        return self.base[chunk * self.m * self.dp + self.r * self.m * self.n + off]


def serial_reference(lay, replicas, steps, method, dp, streaming=(1, 0, 0.0)):
    """Every iteration, each replica that trains then (its first H_r of every round) takes one inner step
    on its own model copy and AdamW; then, at the end of a round (and of training), torch.optim.SGD on an
    fp32 global copy with the sample-weighted pseudo-gradient (Local SGD: lr 1, no momentum: the weighted
    mean of the weights), every replica continuing from the global weights. streaming = (K fragments, delay,
    alpha): fragment f (layer i of L in i K // L; embeddings first, the rest last) instead syncs at the
    iterations it % H == (f + 1) H // K mod H, its update applied `delay` iterations later and mixed in as
    alpha x local + (1 - alpha) x global; at the last iteration every pending update is applied and every
    fragment synced unmixed. Returns losses and step-1 grads per replica, the final global weights and
    momentum."""
    from megalite.pipeline.schedules import pipeline_tensor_shape
    from megalite.batching.data_iterators import data_iterators
    from megalite.config.data import LoaderConfig
    from megalite.training.setup import setup
    from megalite.training.step import train_step
    from megalite.tensor_parallel import model_parallel_manual_seed
    entry = importlib.import_module(lay.entry)
    g = int(lay.base[lay.base.index("--global-batch-size") + 1])
    args = parse_args(list(lay.reference_argv()) + ["--global-batch-size", str(g // replicas)], world_size=1)
    ps.initialize_model_parallel(1, 1)
    base = learnable_datasets(args, [g * STEPS * 2])[0]
    copies = []
    for r in range(replicas):
        model_parallel_manual_seed(args.seed)
        mcfg, _, chunks, opt, _ = setup(args, entry.model_provider)
        contiguous = "--data-parallel-micro-batch-sizes" in lay.flags  # slices of g / dp per DP rank
        copies.append((chunks, opt, ReplicaView(base, r, replicas, dp,
                                                g // dp if contiguous else args.micro_batch_size)))
    named = [n for n, _ in copies[0][0][0].module.named_parameters()]
    glob = [p.detach().clone() for p in copies[0][0][0].module.parameters()]
    sgd = torch.optim.SGD(glob, lr=1.0 if method == LOCAL_SGD else 0.7, momentum=0.0 if method == LOCAL_SGD else 0.9,
                          nesterov=method != LOCAL_SGD)
    losses, grads, rnd, micro = [[] for _ in range(replicas)], [None] * replicas, max(steps), args.micro_batch_size
    shape, n_micro = pipeline_tensor_shape(mcfg, micro, ps.grid_of(copies[0][0])), g // replicas // micro
    k, delay, alpha = streaming
    layer = [int(n.split("layers.")[1].split(".")[0]) if "layers." in n else None for n in named]
    frag = [(i * k // args.num_layers) if i is not None else (0 if "embedding" in n else k - 1)
            for i, n in zip(layer, named)]
    trained = [[0] * replicas for _ in range(k)]  # steps per fragment and replica since its last sync
    biases = {i for i, n in enumerate(named) if n.endswith("expert_bias")}  # averaged, not stepped
    pending = []

    def locals_():
        return [list(c[0][0].module.parameters()) for c in copies]

    def pseudo_gradient(ids, counts):
        w = [c / sum(counts) for c in counts]
        return {i: sum(wr * (glob[i] - loc[i]) for wr, loc in zip(w, locals_())) for i in ids if i not in biases}

    @torch.no_grad()
    def average_biases(counts):  # MoE expert biases: the replicas' weighted mean, in float64
        for i in biases:
            glob[i].copy_(sum(c / sum(counts) * loc[i].double() for c, loc in zip(counts, locals_())))
            for loc in locals_():
                loc[i].copy_(glob[i])

    @torch.no_grad()
    def apply(grad, mix):
        for i, p in enumerate(glob):
            p.grad = grad.get(i)
        sgd.step()
        for loc in locals_():
            for i in grad:
                loc[i].copy_(mix * loc[i] + (1 - mix) * glob[i] if mix else glob[i])
    for t in range(STEPS):
        for r, (chunks, opt, view) in enumerate(copies):
            if t % rnd >= steps[r]:
                continue
            its, rec = data_iterators(view, t * (g // replicas), LoaderConfig.of(args), chunks), {"norms": []}
            with parity.recording(rec) if grads[r] is None else contextlib.nullcontext():
                reported, _, _ = train_step(entry.forward_step, its, chunks, opt, n_micro, shape, torch.float32,
                                            loss_divisor=n_micro)
            losses[r].append(sum(float(x["lm loss"]) for x in reported) / n_micro)
            if grads[r] is None:  # step 1, before clipping
                grads[r] = {n: rec["grads"][id(p)] for n, p in zip(named, chunks[0].module.parameters())
                            if p.requires_grad}
            for f in range(k):
                trained[f][r] += 1
        it, last = t + 1, t + 1 == STEPS
        for at, grad in [p for p in pending if p[0] == it or last]:
            apply(grad, alpha)
        pending = [p for p in pending if not (p[0] == it or last)]
        due = range(k) if last else [f for f in range(k) if it % rnd == ((f + 1) * rnd // k) % rnd]
        for f in due:
            grad = pseudo_gradient([i for i in range(len(glob)) if frag[i] == f], trained[f])
            if biases:  # (streaming refuses the expert bias: here f is the whole model)
                average_biases(trained[f])
            trained[f] = [0] * replicas
            if last or not delay:
                apply(grad, 0.0 if last else alpha)
            else:
                pending.append((it + delay, grad))
    mom = {n: sgd.state[p]["momentum_buffer"] for n, p in zip(named, glob) if sgd.state[p]} \
        if method != LOCAL_SGD else {}
    ps.destroy_model_parallel()
    return {"losses": losses, "grads": grads, "params": dict(zip(named, glob)), "momentum": mom}


def semi_sync_mismatches(lay, ranks, ref, steps, method, momentum_from=None):
    """Messages for every quantity of the world (losses, step-1 grads, global weights, outer momentum, the
    count of outer steps) off the serial reference by more than 1e-5, and for replicas that do not end on
    bit-identical weights. momentum_from: the replicas that hold the outer momentum (None: every one; the
    asynchronous mode's server is replica 0)."""
    bad = []
    for r in ranks:
        rep, where = r["collected"]["replica"], f"{lay.name} replica {r['collected']['replica']} rank {r['coords']}"
        c = r["collected"]
        if c["outer steps"] != -(-STEPS // max(steps)):
            bad.append(f"{where}: {c['outer steps']} outer steps")
        k, rnd = len(c["syncs"]), c["round"]  # fragment f: at it % H == (f + 1) H // K mod H, and at the end
        syncs = [sum(1 for it in range(1, STEPS) if it % rnd == (f + 1) * rnd // k % rnd) + 1 if e else 0
                 for f, e in zip(range(k), c["elements"])]  # (a pipeline stage holds some fragments only)
        if c["syncs"] != syncs or c["bytes"] != 4 * sum(n * e for n, e in zip(syncs, c["elements"])):
            bad.append(f"{where}: fragments synced {c['syncs']} times (want {syncs}), {c['bytes']} bytes sent "
                       f"(want 4 x the synced elements {c['elements']})")
        errs = [abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"][rep])]
        if len(r["losses"]) != len(ref["losses"][rep]) or max(errs) > 1e-5:
            bad.append(f"{where}: losses {r['losses']} vs {ref['losses'][rep]}")
        for what, want in (("grads", ref["grads"][rep]), ("params", ref["params"]),
                           ("momentum", ref["momentum"])):
            got = r[what] if what != "momentum" else r["collected"]["momentum"]
            for name, t in got.items():
                if name.endswith("[last-stage copy]"):
                    name = name.replace(" [last-stage copy]", "")
                w = parity._cut_vocab(name, want[name], parity.VOCAB)
                e = rel_err(t, w)
                if what == "momentum":  # sums of pseudo-gradients, differences of nearly equal weights (norm
                    # weights ~1 move by ~1e-3 in a round): their rounding is the weights', so it is judged on
                    # the weights' scale (an ulp of a weight is 6e-8 of it, 6e-5 of such a difference)
                    e = ((t.double() - w.double()).abs().max() / parity._cut_vocab(
                        name, ref["params"][name], parity.VOCAB).double().abs().max()).item()
                if e > 1e-5:
                    bad.append(f"{where}: {what} {name}: relative error {e:.2e} > 1e-05")
            if what == "momentum" and method == DILOCO and not got and (momentum_from is None or rep in momentum_from):
                bad.append(f"{where}: no outer momentum reported")
    first = {}
    for r in ranks:  # every replica ends on the same global weights, bit for bit
        key = r["coords"]
        for name, t in r["params"].items():
            if (key, name) in first and not torch.equal(first[(key, name)], t):
                bad.append(f"{lay.name}: replicas differ in {name} at {key} after the last outer step")
            first.setdefault((key, name), t)
    return bad
