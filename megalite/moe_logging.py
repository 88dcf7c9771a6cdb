"""The MoE auxiliary losses in the training log line (Megatron's track_moe_metrics): each one's
value per MoE layer, averaged over this iteration's micro-batches (and DP ranks), summed over the
pipeline stages (and the TP ranks' parts of each micro-batch under sequence parallelism), and averaged over the model's MoE layers. Every rank takes part (the names come
from the config, so stages without MoE layers send zeros); the recorded values are then cleared."""

import torch
import torch.distributed as dist

from megalite import parallel_state as ps
from megalite.distributed.collectives import average_over_data_parallel, sum_over_data_parallel
from megalite.moe.router import aux_losses


def moe_loss_names(config):
    names = []
    if config.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss") and config.moe_aux_loss_coeff > 0:
        names.append("load_balancing_loss")
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    return names


def moe_losses(config, num_microbatches, total=None):
    """{name: device scalar}; total: the global micro-batch count with uneven DP shares. With
    --moe-per-layer-logging also {"moe/<name>_layer_<i>": scalar} per MoE layer (Megatron writes those to
    TensorBoard only; the console line skips names with a "/")."""
    names = moe_loss_names(config)
    if not names:
        aux_losses.clear()
        return {}
    dev = ps.get_device()
    layers = [i for i in range(1, config.num_layers + 1) if config.is_moe_layer(i)]
    vals = torch.zeros(len(names), len(layers), device=dev)  # this stage's layers filled, the others 0
    for j, n in enumerate(names):
        for i, layer in enumerate(layers):
            if layer in aux_losses.get(n, {}):
                vals[j, i] = aux_losses[n][layer].to(dev)
    aux_losses.clear()
    vals = sum_over_data_parallel(vals) / total if total is not None else \
        average_over_data_parallel(vals / num_microbatches)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(vals, group=ps.get_pipeline_model_parallel_group())
    if config.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:  # each TP rank's part
        dist.all_reduce(vals, group=ps.get_tensor_model_parallel_group())
    out = dict(zip(names, (vals.sum(dim=1) / len(layers)).unbind()))
    if config.moe_per_layer_logging:
        out.update({f"moe/{n}_layer_{layer}": vals[j, i] for j, n in enumerate(names) for i, layer in enumerate(layers)})
    return out


def dsa_indexer_loss(config, num_microbatches, total=None):
    """{"indexer loss": device scalar} with DSA and --dsa-indexer-loss-coeff > 0 (Megatron's
    track_indexer_metrics): each layer's coeff-scaled KL loss averaged over the micro-batches and DP ranks,
    summed over the pipeline stages, averaged over the layers. Every TP rank holds the whole loss (the
    indexer sees the whole sequence): no sum over TP. Collective on every rank; the values are cleared."""
    per_layer = aux_losses.pop("indexer loss", {})
    if config.experimental_attention_variant != "dsa" or not config.dsa_indexer_loss_coeff:
        return {}
    vals = torch.zeros(config.num_layers, device=ps.get_device())
    for layer, value in per_layer.items():
        vals[layer - 1] = value.to(vals.device)
    vals = sum_over_data_parallel(vals) / total if total is not None else \
        average_over_data_parallel(vals / num_microbatches)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(vals, group=ps.get_pipeline_model_parallel_group())
    return {"indexer loss": vals.sum() / config.num_layers}
