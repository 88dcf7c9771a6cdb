"""One candidate layout: the parallel sizes, ZeRO stage, recompute and micro-batch a plan chooses, the
pretrain_gpt.py flags that launch it (megalite/cli/plan.py validates them with megalite's own checks)."""

import dataclasses

from megalite.config import ConfigError

# flags a layout sets: stripped from the user's own before the layout's are added
LAYOUT_FLAGS = {"--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1,
                "--num-layers-per-virtual-pipeline-stage": 1, "--context-parallel-size": 1,
                "--expert-model-parallel-size": 1, "--expert-tensor-parallel-size": 1, "--zero-stage": 1,
                "--recompute-granularity": 1, "--recompute-method": 1, "--recompute-num-layers": 1,
                "--micro-batch-size": 1, "--sequence-parallel": 0, "--use-distributed-optimizer": 0,
                "--recompute-activations": 0, "--num-virtual-stages-per-pipeline-rank": 1,
                "--decoder-first-pipeline-num-layers": 1, "--decoder-last-pipeline-num-layers": 1,
                "--pipeline-model-parallel-layout": 1, "--data-parallel-shares": 1,
                "--data-parallel-micro-batch-sizes": 1, "--optimizer-cpu-offload": 0, "--optimizer-offload-fraction": 1}


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    vp: int = None  # layers per virtual stage (interleaved 1F1B), None: plain 1F1B
    ep: int = None  # MoE only
    zero: int = 0  # 0: plain optimizer; 1, 2, 3: --use-distributed-optimizer --zero-stage
    recompute: str = None  # None, "selective" or "full" (uniform, one layer per checkpoint)
    micro: int = 1
    sp: bool = True  # sequence parallelism whenever TP > 1
    stage_layers: tuple = None  # layers per pipeline stage where not an even split (--pipeline-model-parallel-layout)
    shares: tuple = None  # micro-batches per DP rank where not equal (--data-parallel-shares: GPUs of other speeds)
    etp: int = None  # MoE: the experts' TP size (megalite's default: the TP size)
    micros: tuple = None  # micro-batch size per DP replica where not equal (--data-parallel-micro-batch-sizes)
    offload: tuple = None  # optimizer fraction per DP replica kept on the host (--optimizer-cpu-offload)
    chunks: int = None  # interleaving with unequal chunks: chunks per stage (stage_layers: pp x chunks counts, whose
    # --pipeline-model-parallel-layout gives the chunks by itself)

    def chunks_per_stage(self, num_layers):
        """Model chunks per pipeline stage of a model of num_layers layers (1: plain 1F1B)."""
        return self.chunks or (num_layers // (self.pp * self.vp) if self.vp else 1)

    @property
    def expert_tp(self):
        return self.tp if self.etp is None else self.etp

    @property
    def world(self):
        return self.tp * self.pp * self.cp * self.dp

    def flags(self):
        f = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]
        if self.tp > 1 and self.sp:
            f.append("--sequence-parallel")
        if self.vp:
            f += ["--num-layers-per-virtual-pipeline-stage", str(self.vp)]
        if self.cp > 1:
            f += ["--context-parallel-size", str(self.cp)]
        if self.ep:
            f += ["--expert-model-parallel-size", str(self.ep), "--expert-tensor-parallel-size", str(self.expert_tp)]
        if self.zero:
            f += ["--use-distributed-optimizer", "--zero-stage", str(self.zero)]
        if self.recompute == "full":
            f += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
        elif self.recompute:
            f += ["--recompute-granularity", self.recompute]
        if self.stage_layers:
            from megalite.pipeline.auto_layout import layout_string
            f += ["--pipeline-model-parallel-layout", layout_string(self.stage_layers)]
        if self.shares:
            f += ["--data-parallel-shares", ",".join(map(str, self.shares))]
        if self.micros:
            f += ["--data-parallel-micro-batch-sizes", ",".join(map(str, self.micros))]
        if self.offload:
            f += ["--optimizer-cpu-offload", "--optimizer-offload-fraction",
                  ",".join(map(str, self.offload)) if len(set(self.offload)) > 1 else str(self.offload[0])]
        return f + ["--micro-batch-size", str(self.micro)]

    def micro_of(self, d):
        """DP replica d's micro-batch size."""
        return self.micros[d] if self.micros else self.micro

    def describe(self):
        parts = [f"TP{self.tp}" + ("+SP" if self.tp > 1 and self.sp else ""), f"PP{self.pp}"
                 + (f"(v{self.vp})" if self.vp else f"({self.chunks} chunks)" if self.chunks else ""), f"CP{self.cp}",
                 f"DP{self.dp}"]
        parts += [f"EP{self.ep}" + (f"(ETP{self.expert_tp})" if self.expert_tp != 1 else "")] if self.ep else []
        parts += [f"ZeRO-{self.zero}" if self.zero else "no ZeRO", self.recompute or "no recompute",
                  f"mbs {','.join(map(str, self.micros)) if self.micros else self.micro}"]
        parts += [f"layers {'/'.join(map(str, self.stage_layers))}"] if self.stage_layers else []
        parts += [f"shares {','.join(map(str, self.shares))}"] if self.shares else []
        parts += [f"offload {','.join(map(str, self.offload))}"] if self.offload else []
        return " ".join(parts)


def strip_layout_flags(argv):
    """The user's flags without those a layout sets (their values too)."""
    out, i = [], 0
    while i < len(argv):
        flag, joined = argv[i].split("=", 1)[0], "=" in argv[i]  # --flag value, or --flag=value
        n = LAYOUT_FLAGS.get(flag)
        if n is None:
            out.append(argv[i])
            i += 1
        else:
            i += 1 + (0 if joined else n)
    return out


def layout_of(cfg):
    """The layout a validated pretrain_gpt.py command line asks for (cfg: its PlanConfig, config/plan.py; one
    ConfigError line for what a Layout cannot describe: interleaving with unequal chunks, full recompute other than
    one layer per checkpoint)."""
    from megalite.transformer.pipeline_layers import stage_layer_counts
    full = cfg.recompute_granularity == "full"
    if full and (cfg.recompute_method != "uniform" or (cfg.recompute_num_layers or 1) != 1):
        raise ConfigError("the planner models full recompute as --recompute-method uniform --recompute-num-layers 1; "
                          f"not --recompute-method {cfg.recompute_method} --recompute-num-layers "
                          f"{cfg.recompute_num_layers}")
    pp, L, v = cfg.pipeline_model_parallel_size, cfg.num_layers, cfg.virtual_pipeline_model_parallel_size
    counts, vp = None, None
    chunks = None
    if v:
        cut = tuple(cfg.pipeline_layout or [L // (pp * v)] * (pp * v))  # (virtual stage k: stage k % pp)
        if len(set(cut)) > 1 or L % (pp * v):
            chunks, counts = v, cut  # unequal chunks (first/last stages, an explicit layout): priced chunk by chunk
        else:
            vp = L // (pp * v)
    else:
        cut = tuple(cfg.pipeline_layout or stage_layer_counts(L, pp, cfg.decoder_first_pipeline_num_layers,
                                                                cfg.decoder_last_pipeline_num_layers))
        even = tuple(stage_layer_counts(L, pp, None, None)) if L % pp == 0 else None  # (uneven: only given cuts)
        counts = cut if cut != even else None
    ep = cfg.expert_model_parallel_size if cfg.num_experts else None
    etp = (cfg.expert_tensor_parallel_size or cfg.tensor_model_parallel_size) if ep else None
    micros = _micros(cfg)
    micro = cfg.data_parallel_micro_batch_sizes[0] if cfg.data_parallel_micro_batch_sizes and not micros \
        else cfg.micro_batch_size  # (equal sizes given: that size everywhere)
    return Layout(cfg.tensor_model_parallel_size, pp, cfg.context_parallel_size, cfg.data_parallel_size, vp, ep,
                  (cfg.zero_stage or 1) if cfg.use_distributed_optimizer else 0,
                  "full" if full else cfg.recompute_granularity, micro, cfg.sequence_parallel,
                  counts, _shares(cfg), etp, micros, _offload(cfg), chunks)


def _offload(cfg):
    """--optimizer-cpu-offload's fraction per DP replica (None without it)."""
    if not cfg.optimizer_cpu_offload:
        return None
    f = cfg.optimizer_offload_fraction
    if f == "auto":
        from megalite.planner.memory import OFFLOAD_AUTO
        raise ConfigError(OFFLOAD_AUTO)
    return tuple(float(x) for x in f) if isinstance(f, (list, tuple)) else (float(f),) * cfg.data_parallel_size


def _micros(cfg):
    sizes = cfg.data_parallel_micro_batch_sizes
    if sizes == "auto":
        raise ConfigError("the planner prices given --data-parallel-micro-batch-sizes, not auto (measured at start): "
                          "give the sizes, or leave the flag out and let the search choose them")
    return tuple(sizes) if sizes and len(set(sizes)) > 1 else None


def _shares(cfg):
    s = cfg.data_parallel_shares
    if not s or s == "auto":
        return None
    return tuple(int(x) for x in str(s).split(",")) if not isinstance(s, (list, tuple)) else tuple(s)
