"""The model's Megatron flags: sizes and architecture (norms, positions, attention variants: MLA and
DSA), Mixture of Experts, muP and BERT, with Megatron's names and defaults. megalite/cli/parser.py
adds them to its parser and maps them to ModelConfig (model_config)."""

import argparse

from megalite.config import ConfigError
from megalite.cli.features.mup import MUP_FLAGS


def add_model_flags(a):
    """a: the parser's add_argument."""
    # model (Megatron requires the sizes: no defaults)
    a("--num-layers", type=int, default=None)
    a("--hidden-size", type=int, default=None)
    a("--ffn-hidden-size", type=int, default=None, help="default 4h; with --swiglu int(8h/3/64)*64, as Megatron")
    a("--num-attention-heads", type=int, default=None)
    a("--kv-channels", type=int, default=None)
    a("--group-query-attention", action="store_true")
    a("--num-query-groups", type=int, default=1)
    a("--seq-length", type=int, default=None)
    a("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    a("--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope"])
    a("--no-position-embedding", action="store_false", dest="add_position_embedding",
      help="deprecated in Megatron: accepted with --position-embedding-type rope (which has no position table)")
    a("--rotary-base", type=float, default=10000.0)
    a("--rotary-percent", type=float, default=1.0, help="fraction of each head's dims that rotary rotates")
    a("--use-rope-scaling", action="store_true",
      help="Llama 3.1's rope scaling: frequencies whose wavelength exceeds the original context / low factor "
           "divided by --rope-scaling-factor, those below the original context / high factor kept, a smooth "
           "blend between")
    a("--rope-scaling-factor", type=float, default=None,
      help="with --use-rope-scaling (default 8, Llama 3.1's; 3.2: 32)")
    a("--rope-scaling-low-freq-factor", type=float, default=None,
      help="with --use-rope-scaling (megalite's; default 1)")
    a("--rope-scaling-high-freq-factor", type=float, default=None,
      help="with --use-rope-scaling (megalite's; default 4)")
    a("--rope-scaling-original-max-position-embeddings", type=int, default=None,
      help="with --use-rope-scaling: the context the model was first trained at (megalite's; default 8192)")
    a("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    a("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    a("--apply-layernorm-1p", action="store_true", help="norm weights stored as w - 1 (zero-centred gamma)")
    a("--qk-layernorm", action="store_true", help="normalize each head's queries and keys (--normalization)")
    a("--window-size", type=_window, default=None,
      help="Megatron's sliding-window attention, 'L,0' (or L): a query at position i attends to keys i - L .. i "
           "(Hugging Face's sliding_window is L + 1); default: every key before it")
    a("--window-attn-skip-freq", type=int, default=None,
      help="with --window-size: every N-th layer attends to all keys (Gemma 2, gpt-oss: 2; Gemma 3: 6)")
    a("--rotary-interleaved", action="store_true",
      help="rotary embeddings rotate adjacent pairs of dims (2i, 2i+1) instead of the two halves of each head")
    a("--apply-query-key-layer-scaling", action="store_true",
      help="fp16: attention scores computed divided by the layer number and multiplied back in the fp32 "
           "softmax (same function, no fp16 overflow of large scores)")
    a("--swiglu", action="store_true")
    a("--geglu", action="store_true", help="the gated MLP (--swiglu's [gate | up]) with tanh GeLU on its gate "
                                            "instead of SiLU (Gemma's GeGLU; megalite's)")
    a("--embedding-multiplier", type=float, default=1.0,
      help="the word (and position) embeddings times this before dropout (Gemma: sqrt(hidden); megalite's)")
    _moe_flags(a)
    _mup_flags(a)
    _mla_flags(a)
    _bert_flags(a)


def _moe_flags(a):
    """Mixture of Experts (megalite/moe/)."""
    a("--num-experts", type=int, default=None, help="experts per MoE layer")
    a("--moe-router-topk", type=int, default=2, help="experts per token")
    a("--moe-ffn-hidden-size", type=int, default=None, help="each expert's FFN size (default --ffn-hidden-size)")
    a("--moe-layer-freq", type=moe_layer_freq, default=1,
      help="every k-th layer is MoE (int), or a 0/1 pattern per layer, e.g. '([1]*3+[0])*2'")
    a("--moe-router-load-balancing-type", default="aux_loss", choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"])
    a("--moe-aux-loss-coeff", type=float, default=0.0)
    a("--moe-z-loss-coeff", type=float, default=None)
    a("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    a("--moe-router-pre-softmax", action="store_true", help="softmax over all experts before the top-k")
    a("--moe-router-topk-scaling-factor", type=float, default=None)
    a("--mtp-num-layers", type=int, default=None, help="multi-token prediction: this many extra depths after the "
      "decoder (DeepSeek-V3), each predicting one token further ahead; on the last pipeline stage")
    a("--mtp-loss-scaling-factor", type=float, default=0.1, help="the MTP loss, averaged over the depths, times this")
    a("--moe-router-num-groups", type=int, default=None, help="experts in this many groups (DeepSeek-V3's "
      "group-limited routing, with --moe-router-group-topk)")
    a("--moe-router-group-topk", type=int, default=None, help="each token's experts come from its best this many "
      "groups (a group's score: the sum of its top topk / group-topk expert scores)")
    a("--moe-router-enable-expert-bias", action="store_true",
      help="aux-loss-free balancing: a per-expert bias (sigmoid scores) moved towards equal loads each step")
    a("--moe-router-bias-update-rate", type=float, default=1e-3)
    a("--moe-router-dtype", default=None, choices=["fp32", "fp64"], help="routing precision (default fp32)")
    a("--moe-grouped-gemm", action="store_true", help="the local experts as two Triton grouped GEMMs (fc1, fc2) "
      "on CUDA; on CPU they run one after the other")
    a("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall", "flex"])
    a("--moe-per-layer-logging", action="store_true", help="each MoE layer's router losses to TensorBoard")
    a("--expert-model-parallel-size", type=int, default=1, help="ranks the experts are split over (MoE)")
    a("--expert-tensor-parallel-size", type=int, default=None, help="MoE experts' TP size (only 1 for now)")
    a("--moe-expert-capacity-factor", type=float, default=None,
      help="drop tokens over ceil(T·k/E · factor) per expert")
    a("--moe-token-drop-policy", default="probs", choices=["probs", "position"])
    a("--moe-pad-expert-input-to-capacity", action="store_true")
    a("--moe-shared-expert-intermediate-size", type=int, default=None, help="a shared expert of this FFN size")
    a("--moe-shared-expert-gate", action="store_true", help="scale the shared expert by sigmoid(x·g) (Qwen2-MoE)")
    a("--moe-shared-expert-overlap", action="store_true", help="accepted: the shared expert runs in line")


def _mup_flags(a):
    """muP (the flags' meanings and defaults: megalite/mup.py)."""
    a("--use-mup", action="store_true", help="Maximal Update Parameterization, by hidden / --mup-base-hidden-size")
    for dest, (kind, default, why) in MUP_FLAGS.items():
        a("--" + dest.replace("_", "-"), type=kind, default=default, help=why)


def _mla_flags(a):
    """Multi-latent attention (DeepSeek-V2/V3, megalite/transformer/mla.py) and DeepSeek sparse attention on it
    (megalite/transformer/dsa.py): Megatron's names and defaults."""
    a("--multi-latent-attention", action="store_true", help="low-rank q/kv projections, rope on a shared key part")
    a("--q-lora-rank", type=int, default=None, help="MLA: rank of the query latent (default: no query latent)")
    a("--kv-lora-rank", type=int, default=32)
    a("--qk-head-dim", type=int, default=128)
    a("--qk-pos-emb-head-dim", type=int, default=64)
    a("--v-head-dim", type=int, default=128)
    a("--rope-type", default=None, choices=["rope", "yarn"], help="MLA's rotary embedding (default yarn, as Megatron)")
    a("--rotary-scaling-factor", type=float, default=1.0, help="MLA YaRN: context extension factor")
    a("--mscale", type=float, default=1.0)
    a("--mscale-all-dim", type=float, default=0.0)
    # DeepSeek sparse attention on MLA (megalite/transformer/dsa.py); Megatron's names and defaults
    a("--experimental-attention-variant", default=None, choices=["gdn", "gdn2", "dsa", "gated_delta_net"],
      help="dsa: DeepSeek sparse attention (the others are not implemented)")
    for flag in ("--dsa-indexer-n-heads", "--dsa-indexer-head-dim", "--dsa-indexer-topk"):
        a(flag, type=int, default=None)
    a("--dsa-indexer-topk-freq", type=int, default=1)
    a("--dsa-indexer-skip-topk-offset", type=int, default=0)
    a("--dsa-indexer-loss-coeff", type=float, default=None, help="the indexer's KL loss (None / 0: none)")
    a("--dsa-indexer-use-sparse-loss", action="store_true", help="the indexer's KL loss on the top-k keys only")
    a("--dsa-indexer-rope-interleaved", action="store_true")
    a("--no-dsa-indexer-scoring-relu", "--disable-dsa-indexer-scoring-relu", dest="dsa_indexer_scoring_relu",
      action="store_false")
    a("--dsa-indexer-k-norm-epsilon", type=float, default=None)
    a("--dsa-indexer-k-norm-fp32", action="store_true")
    a("--squared-relu", action="store_true", help="MLP activation relu(x)^2 instead of GeLU")
    a("--untie-embeddings-and-output-weights", action="store_true")
    a("--disable-bias-linear", action="store_true")
    a("--add-qkv-bias", action="store_true", help="a bias on the QKV projection even with --disable-bias-linear "
      "(Qwen)")
    a("--hidden-dropout", type=float, default=0.1)
    a("--attention-dropout", type=float, default=0.1)
    a("--init-method-std", type=float, default=0.02)
    a("--embedding-init-method-std", type=float, default=None,
      help="the embeddings' init std, a tied output layer's with them (default --init-method-std)")
    a("--make-vocab-size-divisible-by", type=int, default=128)
    a("--recompute-granularity", default=None, choices=["full", "selective"])
    a("--recompute-method", default=None, choices=["uniform", "block"])
    a("--recompute-num-layers", type=int, default=None)
    a("--recompute-activations", action="store_true", help="= --recompute-granularity selective (as Megatron)")
    a("--no-fused-kernels", action="store_true", help="use plain torch ops instead of Triton kernels on CUDA")
    a("--no-kernel-self-check", action="store_true",
      help="trust each Triton kernel on a CUDA device without first running it once against its torch fallback "
           "there (the check replaces a kernel that fails on that device; kernels/self_check.py)")
    a("--kernel-choice", default="auto", choices=["auto", "triton", "torch"],
      help="auto: on CUDA, each Triton kernel is timed against its torch fallback (SDPA for attention) per shape "
           "class once its self-check has passed, and the faster runs, the same on every rank (measurements cached "
           "in $MEGALITE_KERNEL_CACHE, default ~/.cache/megalite/kernels); triton: Triton untimed; torch: the "
           "fallbacks everywhere. --no-fused-kernels overrides it (kernels/choice.py)")
    a("--use-flash-attn", action="store_true",
      help="megalite's Triton flash attention (the default on CUDA; this also overrides --no-fused-kernels)")
    a("--deterministic-mode", action="store_true", help="deterministic algorithms only (bitwise-repeatable runs)")


def _bert_flags(a):
    """BERT (pretrain_bert.py)."""
    a("--bert-binary-head", dest="bert_binary_head", action="store_true", default=True,
      help="BERT: pooler + sentence-order head (default, as Megatron)")
    a("--bert-no-binary-head", dest="bert_binary_head", action="store_false", help="BERT: MLM only")
    a("--mask-prob", type=float, default=0.15, help="BERT: fraction of tokens chosen for MLM")
    a("--short-seq-prob", type=float, default=0.1, help="BERT: probability of a shorter target sample length")
    a("--layernorm-position", default=None, choices=["pre", "post"],
      help="post: norm(x + f(x)) (original BERT; pretrain_bert's default); pre: x + f(norm(x)) (GPT's default)")
    a("--openai-gelu", action="store_true", help="BERT: tanh-approximated GeLU (GPT always uses it) instead of erf")




def moe_layer_freq(text):
    """Megatron's --moe-layer-freq: an int k (every k-th layer) or a pattern of 0/1 lists built with
    + and * (e.g. "([1]*3+[0]*1)*2"), read without eval."""
    import ast

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = value(node.left), value(node.right)
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError(text)
    try:
        out = value(ast.parse(str(text).strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r}: an int or a pattern such as '([1]*3+[0]*1)*2'") from None
    if isinstance(out, int) and out >= 1 or isinstance(out, list) and out and all(v in (0, 1) for v in out):
        return out
    raise argparse.ArgumentTypeError(f"{text!r}: an int >= 1 or a list of 0/1 per layer")


ROPE_SCALING_DEFAULTS = {"rope_scaling_factor": 8.0, "rope_scaling_low_freq_factor": 1.0,
                         "rope_scaling_high_freq_factor": 4.0, "rope_scaling_original_max_position_embeddings": 8192}


def fill_rope_scaling(args):
    """The rope-scaling flags' defaults (Llama 3.1's), after refusing one given without --use-rope-scaling (it would
    change nothing)."""
    given = [f"--{k.replace('_', '-')}" for k in ROPE_SCALING_DEFAULTS if getattr(args, k) is not None]
    if given and not args.use_rope_scaling:
        raise ConfigError(f"{given[0]} applies only with --use-rope-scaling (Llama 3.1's scaling): add it, or drop "
                          f"{given[0]}")
    for k, v in ROPE_SCALING_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def _window(text):
    """--window-size 'L,R' (Megatron's tuple; R, the keys after a query, 0 for a causal model) or 'L' -> L."""
    parts = text.strip("()[] ").split(",")
    try:
        left, right = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window-size {text!r}: give 'L,0' (keys before a query; none after it)")
    if len(parts) > 2 or left < 0 or right != 0:
        raise argparse.ArgumentTypeError(f"--window-size {text!r}: a causal model takes 'L,0' with L >= 0 (keys after "
                                         "a query: 0)")
    return left


def validate_window(args):
    """--window-size / --window-attn-skip-freq against what they do not compose with yet, one line each."""
    if args.window_attn_skip_freq is not None and (args.window_size is None or args.window_attn_skip_freq < 1):
        raise ConfigError(f"--window-attn-skip-freq {args.window_attn_skip_freq} needs --window-size (and N >= 1)")
    if args.window_size is None:
        return
    if args.context_parallel_size > 1:
        raise ConfigError("--window-size with --context-parallel-size > 1 is not built yet in megalite (the ring's "
                          "blocks outside the window): drop one")
    if args.model_type == "bert":
        raise ConfigError("--window-size is a causal model's (GPT's) sliding window; BERT attends both ways")
    if args.multi_latent_attention:
        raise ConfigError("--window-size with --multi-latent-attention is not built yet in megalite")
