"""A GEMM's speed by its shape. cuBLAS cuts a GEMM's output into tiles, one thread block each, and runs them in
waves over the GPU's SMs: a tile hanging over the matrix's edge, and a last wave that leaves SMs idle, compute
nothing useful (tile and wave quantization, NVIDIA's "Matrix Multiplication Background" user guide). A layer's
GEMMs run at the GPU type's large-GEMM efficiency (gpus.py) times that utilisation, which is what TP's narrow
shards lose: TP 8 cuts a 10k-wide projection into 3,840 columns, 240 tiles, 2.2 waves of an A100's 108 SMs.

The tile is that of cuBLAS's large 16-bit kernels, 256 x 128 (either orientation, whichever fits the output
better). A GEMM runs three times per pass over a micro-batch: forward (tokens x out), the input's gradient
(tokens x in) and the weight's (in x out). Dense layers only: MLA's projections and MoE experts' GEMMs, whose
row counts follow the routing, count at full utilisation."""

TILE = (256, 128)


def utilisation(m, n, sms):
    """Useful fraction of the thread blocks' work for an m x n output on `sms` SMs (1 where sms is None)."""
    if not sms:
        return 1.0
    best = 0.0
    for tm, tn in (TILE, TILE[::-1]):
        rows, cols = -(-m // tm), -(-n // tn)
        tiles = rows * cols
        waves = -(-tiles // sms)
        best = max(best, m * n / (tiles * tm * tn) * tiles / (waves * sms))
    return best


def layer_gemms(c, tokens, t):
    """(tokens, in, out) of one dense transformer layer's GEMMs on a TP rank: QKV, the attention output
    projection, the MLP's two."""
    d, a, g = c.kv_channels, c.num_attention_heads, c.num_query_groups
    h, ffn = c.hidden_size, c.ffn_hidden_size
    return [(tokens, h, (a + 2 * g) * d // t), (tokens, a * d // t, h),
            (tokens, h, ffn * (2 if c.swiglu else 1) // t), (tokens, ffn // t, h)]


def time_factor(gemms, forward_passes, sms):
    """Passes-weighted seconds of these GEMMs relative to running them at full utilisation once: forward_passes
    forwards (2 under full recompute) and the backward's two GEMMs, each at its output's utilisation; equals
    forward_passes + 2 where every utilisation is 1."""
    flops = sum(m * k * n for m, k, n in gemms)
    if not flops:
        return forward_passes + 2
    slow = sum(m * k * n * (forward_passes / utilisation(m, n, sms) + 1 / utilisation(m, k, sms)
                            + 1 / utilisation(k, n, sms)) for m, k, n in gemms)
    return slow / flops
