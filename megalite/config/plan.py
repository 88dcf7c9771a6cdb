"""What the planner (megalite/planner/) prices a layout from: the parallel sizes and schedule, precision, ZeRO and
the gradients' reduction, the optimizer and its offload, recompute, the replicas' shares and precisions and the
semi-synchronous rounds, with the model, batching and optimizer configurations they make (one validated command
line at one layout: cli/plan.py makes one per candidate)."""

import dataclasses

from megalite.config.batching import BatchingConfig
from megalite.config.from_flags import model_config, training_config
from megalite.config.section import DERIVED, Section


@dataclasses.dataclass(frozen=True)
class PlanConfig(Section):
    num_layers: int
    seq_length: int
    vocab_size: int  # (the planner loads no tokenizer: --vocab-size)
    num_experts: int
    global_batch_size: int
    micro_batch_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int
    context_parallel_size: int
    data_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    sequence_parallel: bool
    pipeline_layout: list  # the layers per (virtual) stage, as validation cut them
    decoder_first_pipeline_num_layers: int
    decoder_last_pipeline_num_layers: int
    recompute_granularity: str
    recompute_method: str
    recompute_num_layers: int
    bf16: bool
    fp16: bool
    use_distributed_optimizer: bool
    zero_stage: int
    ddp_bucket_size: int
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    hierarchical_grad_reduce: bool
    grad_compression: str  # (not priced: refused in one line)
    optimizer: str
    muon_scalar_optimizer: str
    muon_tp_mode: str
    muon_fp32_matmul_prec: str
    decoupled_lr: float
    optimizer_cpu_offload: bool
    optimizer_offload_fraction: object  # a fraction or one per DP replica
    overlap_cpu_optimizer_d2h_h2d: bool
    data_parallel_shares: list
    data_parallel_micro_batch_sizes: list
    data_parallel_precisions: list
    semi_sync_method: str
    semi_sync_replicas: int
    semi_sync_steps: list
    semi_sync_auto: bool
    semi_sync_async: bool
    semi_sync_fragments: int
    semi_sync_fragment_delay: int
    semi_sync_quantize: str
    model: object = dataclasses.field(metadata=DERIVED)  # the ModelConfig, at the run's precision
    training: object = dataclasses.field(metadata=DERIVED)  # the TrainingConfig (Muon's settings, the precision)
    batching: BatchingConfig = dataclasses.field(metadata=DERIVED)

    @classmethod
    def of(cls, args):
        return super().of(args, model=model_config(args), training=training_config(args),
                          batching=BatchingConfig.of(args))

    def at_rank(self, dp_rank):
        """This configuration in DP replica dp_rank's precision (--data-parallel-precisions; itself without)."""
        if not self.data_parallel_precisions:
            return self
        mine = self.data_parallel_precisions[dp_rank]
        training = dataclasses.replace(self.training, bf16=mine == "bf16", fp16=mine == "fp16")
        model = dataclasses.replace(self.model, params_dtype=training.params_dtype)
        return dataclasses.replace(self, bf16=training.bf16, fp16=training.fp16, training=training, model=model)
