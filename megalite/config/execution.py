"""How a model runs, not what it is: Megatron's ModelParallelConfig part of TransformerConfig (parallel
execution, recomputation, the pipeline split, precision, kernels, the token dispatcher, what is recorded for
logging). ModelConfig inherits these, so model code reads one object; the architecture is ModelConfig's own.
Each field declares its flag and checkpoint role once (fields.py): the layout fields are reset when a
checkpoint's model is rebuilt on one process, none of these is a shape a checkpoint must agree on."""

from dataclasses import dataclass
from typing import Annotated, Optional

import torch

from megalite.config.fields import LAYOUT, Field


@dataclass
class ExecutionConfig:
    sequence_parallel: Annotated[bool, LAYOUT] = False
    recompute_granularity: Annotated[Optional[str], LAYOUT] = None  # None, "full" or "selective"
    # with "full": "uniform" (chunks of N layers) or "block" (first N)
    recompute_method: Annotated[Optional[str], LAYOUT] = None
    recompute_num_layers: Annotated[Optional[int], LAYOUT] = None
    params_dtype: Annotated[torch.dtype, Field(flag=None)] = torch.float32
    decoder_first_pipeline_num_layers: Annotated[Optional[int], LAYOUT] = None  # uneven pipeline split
    decoder_last_pipeline_num_layers: Annotated[Optional[int], LAYOUT] = None
    # layers per (virtual) stage (--pipeline-model-parallel-layout)
    pipeline_layout: Annotated[Optional[tuple], Field(flag=None, layout=True)] = None
    # interleaved: contiguous micro-batches (default PP)
    microbatch_group_size_per_vp_stage: Annotated[Optional[int], Field(
        "microbatch_group_size_per_virtual_pipeline_stage", layout=True)] = None
    # 1f1b | interleaved | zb-h1 | zbv | dualpipev (megalite/pipeline/schedules.py; None: by the layout)
    pipeline_schedule: Annotated[Optional[str], LAYOUT] = None
    fused_kernels: Annotated[bool, Field(flag=None)] = True  # Triton kernels on CUDA; CPU always uses the torch path
    seed: int = 1234  # initialisation seed (topology independent)
    use_flash_attn: bool = False  # flash attention even with fused_kernels off
    # context parallelism's attention: p2p/a2a/allgather/a2a+p2p, or one per layer
    cp_comm_type: Annotated[Optional[list], Field(flag=None, layout=True)] = None
    deterministic: Annotated[bool, Field("deterministic_mode")] = False  # deterministic algorithms only
    calculate_per_token_loss: bool = False  # loss summed over tokens, divided by the global batch's count
    qk_clip: bool = False  # MuonClip: attention records its largest logit per head (optimizer/qk_clip.py)
    log_max_attention_logit: bool = False  # ... recorded (and logged) without clipping
    moe_token_dispatcher_type: str = "allgather"  # or alltoall (the same result; other collectives)
    moe_per_layer_logging: bool = False  # each MoE layer's losses to TensorBoard / --log-json
    moe_grouped_gemm: bool = False  # the experts as two Triton grouped GEMMs on CUDA (a loop on CPU)
    # FP8 GEMMs in the transformer layers' linear layers (tensor_parallel/fp8.py): e4m3 / hybrid, or None
    fp8: Annotated[Optional[str], Field("fp8_format")] = None
    fp8_recipe: str = "delayed"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True  # the weight gradient's GEMM in FP8 too (--no-fp8-wgrad: in the model's precision)
    fp8_param_gather: bool = False  # FP8 weights quantized at the step, moved so by ZeRO (distributed/fp8_gather.py)
    first_last_layers_bf16: bool = False  # the first / last layers stay in the model's precision
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
