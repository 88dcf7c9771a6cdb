"""--fp8-param-gather: the FP8 layers' weights quantized from the fp32 main weights right after the optimizer step
(as Transformer Engine's FP8 parameters are), and their FP8 bytes are what ZeRO-1/2's parameter all-gather and
ZeRO-3's unit gathers (each time a unit is gathered, for its forward and again for its backward) move:
one byte an element instead of the model dtype's two (bf16 / fp16), plus one fp32 scale a weight that every rank
derives from an all-reduced amax rather than receives.

After each step: each FP8 weight's amax over the elements this rank owns, reduced (max) over the ranks that shard
the bucket and over TP (the site's whole-tensor amax); the scale from it as the site's recipe says (tensorwise:
that amax; delayed: the amax history's, that amax before any history); this rank's pieces quantized from their
fp32 main values. Each bucket holding an FP8 weight then all-gathers one byte string per rank: its pieces in
bucket order, an FP8 weight's as its FP8 bytes, any other parameter's as its model-dtype bytes (each rank's string
padded to the longest). Every rank unpacks them: an FP8 weight gets its whole FP8 copy and scale (`fp8_weight`,
which its GEMMs use as they are) and, in the model's buffer, the dequantized values (for what reads the weights:
checkpoints, the replica hash); other parameters their values.

The arithmetic does not depend on the layout: every scale is of the whole weight and every element is quantized
from the same fp32 main value, whichever rank owns it; one data-parallel rank computes exactly what several do."""

import torch

from megalite.distributed import comm
from megalite.tensor_parallel.fp8 import scale_inverse, scaled
from megalite.tensor_parallel.mappings import max_over_tensor_model_parallel_region


def fp8_sites(chunks):
    """{weight parameter: its Fp8Site} of the chunks' FP8 linear layers."""
    return {m.weight: m.fp8 for c in chunks for m in c.module.modules() if getattr(m, "fp8", None) is not None}


def weight_scale(site, amax):
    """The scale a site's recipe takes for its weight given the weight's current whole amax (as site.quantize)."""
    if site.recipe == "tensorwise":
        return amax
    h = site.history["w"].to(amax.device)
    known = h.max() if site.algo == "max" else h[0]
    return torch.where(known > 0, known, amax)


class Fp8Wire:
    """One bucket's byte strings: every rank's pieces in bucket order (static, derived from the bucket's layout)."""

    def __init__(self, bucket, sites):
        self.bucket, self.sites = bucket, sites
        self.width = bucket.param_data.element_size()
        self.segments, offset = [[] for _ in range(bucket.dp)], 0
        for p in bucket.params:
            n = p.numel()
            for r in range(bucket.dp):
                a, b = max(offset, r * bucket.shard), min(offset + n, (r + 1) * bucket.shard)
                if b > a:
                    self.segments[r].append((p, a - offset, b - offset, a))
            offset += n
        self.sizes = [sum((b - a) * (1 if p in sites else self.width) for p, a, b, _ in segs) for segs in self.segments]
        self.longest = max(self.sizes)
        self.handle = self.out = None

    def bytes_per_gather(self):
        return self.longest * self.bucket.dp

    def start(self, quantized, async_op):
        """Send this rank's string (FP8 weights' pieces from `quantized`: {param: uint8 piece}); unpacked by
        finish()."""
        b, mine, at = self.bucket, torch.zeros(self.longest, dtype=torch.uint8, device=self.bucket.param_data.device), 0
        # (ZeRO-3: this rank's values are its shard, the bucket's buffer being freed between gathers)
        own, base = (b.param_shard, b.lo) if b.stage == 3 else (b.param_data, 0)
        for p, lo, hi, flat in self.segments[b.lo // b.shard]:
            n = (hi - lo) * (1 if p in self.sites else self.width)
            mine[at:at + n] = quantized[p] if p in self.sites else own[flat - base:flat - base + hi - lo].view(
                torch.uint8)
            at += n
        if b.dp == 1:
            self.out = mine
            return
        self.out = torch.empty(self.longest * b.dp, dtype=torch.uint8, device=mine.device)
        self.handle = comm.all_gather(self.out, mine, group=b.group, async_op=async_op)

    def finish(self, scales):
        """Unpack every rank's string: FP8 weights' bytes into their whole FP8 copies (and the dequantized values
        into the model's buffer), other parameters' values into the buffer."""
        if self.out is None:
            return
        if self.handle is not None:
            self.handle.wait()
        b = self.bucket
        for p in self.bucket.params:  # (ZeRO-3: a weight's FP8 copy exists while its unit is gathered)
            if p in self.sites and p.fp8_bytes is None:
                p.fp8_bytes = torch.empty(p.numel(), dtype=torch.uint8, device=b.param_data.device)
        for r, segs in enumerate(self.segments):
            at = r * self.longest if b.dp > 1 else 0
            for p, lo, hi, flat in segs:
                n = hi - lo
                if p in self.sites:
                    raw = self.out[at:at + n]
                    cache = p.fp8_bytes
                    cache[lo:hi] = raw
                    b.param_data[flat:flat + n] = (raw.view(self.sites[p].forward_dtype).float() * scales[p][1]).to(
                        b.param_data.dtype)
                    at += n
                else:
                    b.param_data[flat:flat + n] = self.out[at:at + n * self.width].view(b.param_data.dtype)
                    at += n * self.width
        for p in {p for segs in self.segments for p, *_ in segs if p in self.sites}:
            p.fp8_weight = (p.fp8_bytes.view(self.sites[p].forward_dtype).view(p.shape), *scales[p][1:])
        self.handle = self.out = None


class Fp8ParamGather:
    """The distributed optimizer's side: after a step, the scales and this rank's quantized pieces; the buckets'
    gathers move them (ShardedBucket.start_param_gather / finish_param_gather with its `wire`)."""

    def __init__(self, chunks, pieces, main_params, grid):
        self.sites, self.grid = fp8_sites(chunks), grid
        self.params = [p for c in chunks for b in c.buckets for p in b.params if p in self.sites]
        self.owned = [(pc, mp) for pc, mp in zip(pieces, main_params) if pc.param in self.sites]
        self.buckets = [b for c in chunks for b in c.buckets if any(p in self.sites for p in b.params)]
        gathered_per_unit = {p for b in self.buckets if b.stage == 3 for p in b.params}
        for p in self.params:  # (ZeRO-3: a copy made at each gather, freed with the unit)
            p.fp8_bytes = None if p in gathered_per_unit else torch.zeros(p.numel(), dtype=torch.uint8, device=p.device)
        for b in self.buckets:
            b.wire, b.fp8_gather = Fp8Wire(b, self.sites), self
        self.scales, self.quantized = {}, {}

    @torch.no_grad()
    def prepare(self):
        """Before the buckets' gathers: every FP8 weight's (the amax its scale comes from, the scale's inverse, its
        current whole amax), and this rank's pieces in FP8."""
        if not self.params:
            return
        index = {p: i for i, p in enumerate(self.params)}
        local = torch.zeros(len(self.params), dtype=torch.float32, device=self.params[0].device)
        for pc, mp in self.owned:
            i = index[pc.param]
            local[i] = torch.maximum(local[i], mp.detach().abs().amax().float())
        b = self.buckets[0]
        if b.dp > 1:  # (every bucket of a chunk is sharded over the same ranks)
            comm.all_reduce(local, group=b.group, op=torch.distributed.ReduceOp.MAX)
        amax = max_over_tensor_model_parallel_region(local, grid=self.grid)  # (every FP8 weight is TP-sharded)
        self.scales = {}
        for p, i in index.items():
            site, used = self.sites[p], weight_scale(self.sites[p], amax[i])
            self.scales[p] = (used, scale_inverse(site.forward_dtype, used, site.margin), amax[i])
        self.quantized = {}
        for pc, mp in self.owned:
            site = self.sites[pc.param]
            with site.kernels():
                q, _ = scaled(mp.detach(), site.forward_dtype, self.scales[pc.param][0], site.margin)
            self.quantized[pc.param] = q.reshape(-1).view(torch.uint8)

    def ready(self):
        """Whether a step has quantized the weights (before the first, ZeRO-3 gathers the model's own dtype)."""
        return bool(self.scales)

    def start(self, bucket, async_op):
        bucket.wire.start(self.quantized, async_op)

    def finish(self, bucket):
        bucket.wire.finish(self.scales)
