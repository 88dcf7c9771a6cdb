"""What the parity harness (parity.py) trains: the base model and its flavours (Llama, eight layers, two samples
per micro-batch, MoE, sinkhorn, the expert bias, DeepSeek-V3 in small), the training flags, and data a model can
learn (a bigram chain). A leaf: parity.py re-exports every name, so tests import them from there."""

import numpy as np


VOCAB, ALPHABET, STEPS = 128, 24, 6
MODEL = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         f"--vocab-size {VOCAB} --make-vocab-size-divisible-by 8 --hidden-dropout 0 --attention-dropout 0").split()
# Clipping at 1.0 engages (step-1 norms ~2), so a wrong norm changes the update too.
# Adam eps 1e-3 instead of 1e-8: with a tiny eps Adam moves an element whose gradient is pure
# rounding noise (e.g. the attention key bias, whose gradient is mathematically zero) by
# +-lr, whatever the noise's size, and layouts sum in different orders, so parameters would
# differ by ~lr after one step. With eps 1e-3 such an element moves by lr * 1e-9 / 1e-3, and
# gradients of a few 1e-4 (sums that nearly cancel) no longer turn last-bit differences into
# parameter differences: the largest parameter error over seeds fell from 7.8e-6 (eps 1e-4,
# TP2xPP2 interleaved Llama) to 3.0e-6 (over 25 layouts x seeds), well inside the 1e-5 bound; the loss still falls by
# more than 0.5 in 6 steps.
TRAIN = (f"--micro-batch-size 1 --global-batch-size 8 --train-iters {STEPS} --lr 1e-2 --lr-warmup-iters 0 "
         "--lr-decay-style constant --clip-grad 1.0 --adam-eps 1e-3 --log-interval 1000 --eval-interval 0 "
         "--eval-iters 0 --num-workers 0 --ddp-bucket-size 3000 --seed 1234").split()
BASE = tuple(MODEL + TRAIN)
# `model=` flavours: the Llama family (rotary positions, RMSNorm, SwiGLU, grouped-query
# attention, no linear biases, untied output layer); 8 layers for PP4 interleaving (at LR 1e-2
# the 8-layer model's loss jumps back up by step 6; at 5e-3 over 8 steps it falls by 0.9-1.1
# for seeds 1234, 2, 3).
LLAMA = ("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--num-attention-heads", "8",
         "--group-query-attention", "--num-query-groups", "4", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights")
EIGHT_LAYERS = ("--num-layers", "8", "--lr", "5e-3", "--train-iters", "8")
# Two samples per micro-batch (the global batch stays 8: half the micro-batches). A world of TP, CP or EP ranks
# spends most of its time in its collectives' latency, one round per layer and micro-batch on the 2-core machine,
# so halving the micro-batches halves its time (all axes 38 s -> 19 s, the CP MoE / MLA world 36 s -> 20 s); it
# also runs every batch dimension above 1, which one-sample micro-batches never show transposed. The
# modules of TP / CP / EP worlds take it in `model=` (their references too); PP layouts that need more
# micro-batches than their stages, the canonical layouts of test_parity.py, sinkhorn routing and BERT (its
# two-element binary-head bias ends 1.1e-5 apart under ATen's default kernels) stay at one sample.
MB2 = ("--micro-batch-size", "2")
DTYPE_FLAGS = {"fp32": (), "bf16": ("--bf16",), "fp16": ("--fp16", "--initial-loss-scale", "4096")}
TIED = "embedding.word_embeddings.weight"



# a small MoE (4 experts, top-2, aux and z losses) every MoE parity test shares; EP and the dispatcher are
# each layout's flags
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "0.001", "--moe-ffn-hidden-size", "48")
# aux-loss-free balancing (DeepSeek-V3's sigmoid scores and expert bias), at a rate that moves routing in a few steps
# S-BASE routing: no aux loss (Megatron's sinkhorn has none)
SINKHORN = tuple(a if a != "0.01" else "0" for a in MOE) + ("--moe-router-load-balancing-type", "sinkhorn")
MOE_BIAS = ("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate", "1e-2")
# DeepSeek-V3's shape in small: MLA (q latent, norms, YaRN with both mscales, value heads of their own size), a
# shared expert, sigmoid routing with the expert bias, 2 groups (each token's experts from its best group), weights
# renormalised and scaled by 2.5; each test adds its layers (--num-layers, --moe-layer-freq: the first dense)
DEEPSEEK = ("--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8",
            "--qk-pos-emb-head-dim", "4", "--v-head-dim", "12", "--qk-layernorm", "--normalization", "RMSNorm",
            "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-6", "--rotary-scaling-factor", "4",
            "--mscale", "1.0", "--mscale-all-dim", "0.8", "--num-experts", "4", "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", "24", "--moe-shared-expert-intermediate-size", "48") + MOE_BIAS + (
            "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
            "--moe-aux-loss-coeff", "0")


# -- learnable data ------------------------------------------------------------------------
class BigramChainDataset:
    """Sample i: a random first symbol, then symbol -> PERM[symbol] (a seed-fixed bijection of
    the first ALPHABET tokens). Independent of who reads it, like the mock data."""

    def __init__(self, num_samples, seq_length, seed):
        self.n, self.seq, self.seed = int(num_samples), int(seq_length), int(seed)
        self.perm = np.random.default_rng([seed, 99]).permutation(ALPHABET)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = np.empty(self.seq + 1, dtype=np.int64)
        x[0] = np.random.default_rng([self.seed, int(i)]).integers(ALPHABET)
        for t in range(self.seq):
            x[t + 1] = self.perm[x[t]]
        return {"text": x}


def learnable_datasets(args, num_samples):
    return BigramChainDataset(num_samples[0], args.seq_length, args.seed), None, None
