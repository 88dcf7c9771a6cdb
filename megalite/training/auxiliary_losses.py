"""The auxiliary losses in the training log line: the MoE routers' (Megatron's track_moe_metrics),
DSA's indexer loss (its track_indexer_metrics) and multi-token prediction's per depth ("mtp_k loss", its
MTPLossLoggingHelper; each CP rank records its part of a depth's mean, so they are summed over CP).
Each one's value per layer is averaged over this iteration's micro-batches (and DP ranks), summed over
the pipeline stages (and, for the routers, over the TP ranks' parts of each micro-batch under sequence
parallelism), and averaged over the layers.
Every rank takes part (the names come from the config, so stages without such layers send zeros);
the recorded values (the model's AuxLossTracker, moe/aux_losses.py) are then cleared."""

import torch
import torch.distributed as dist

from megalite import parallel_state as ps
from megalite.distributed.collectives import average_over_data_parallel, sum_over_data_parallel


def moe_loss_names(config):
    names = []
    if config.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss") and config.moe_aux_loss_coeff > 0:
        names.append("load_balancing_loss")
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    return names


def moe_losses(config, num_microbatches, total, grid, tracker):
    """{name: device scalar}; total: this rank's loss divisor when uneven. With
    --moe-per-layer-logging also {"moe/<name>_layer_<i>": scalar} per MoE layer (Megatron writes those to
    TensorBoard only; the console line skips names with a "/")."""
    names = moe_loss_names(config)
    if not names:
        tracker.clear()
        return {}
    dev = ps.get_device()
    # the MTP layers too (numbered after the decoder's, MoE as its last), as Megatron's tracker counts them
    layers = [i for i in range(1, config.num_layers + (config.mtp_num_layers or 0) + 1) if config.is_moe_layer(i)]
    vals = torch.zeros(len(names), len(layers), device=dev)  # this stage's layers filled, the others 0
    for j, n in enumerate(names):
        for i, layer in enumerate(layers):
            if layer in tracker.values.get(n, {}):
                vals[j, i] = tracker.values[n][layer].to(dev)
    tracker.clear()
    g = grid
    vals = _over_batch_and_stages(vals, num_microbatches, total, g)
    tp = g.tp if config.sequence_parallel else 1
    if tp * g.cp > 1:  # each TP (under SP) and CP rank's part
        dist.all_reduce(vals, group=g.tp_cp_group if g.cp > 1 else g.tp_group)
    out = dict(zip(names, (vals.sum(dim=1) / len(layers)).unbind()))
    if config.moe_per_layer_logging:
        out.update({f"moe/{n}_layer_{layer}": vals[j, i] for j, n in enumerate(names)
                    for i, layer in enumerate(layers)})
    return out


def dsa_indexer_loss(config, num_microbatches, total, grid, tracker):
    """{"indexer loss": device scalar}: each layer's coeff-scaled KL loss. Every TP rank holds the whole
    loss (the indexer sees the whole sequence): no sum over TP."""
    per_layer = tracker.values.pop("indexer loss", {})
    if config.experimental_attention_variant != "dsa" or not config.dsa_indexer_loss_coeff:
        return {}
    vals = torch.zeros(config.num_layers, device=ps.get_device())
    for layer, value in per_layer.items():
        vals[layer - 1] = value.to(vals.device)
    return {"indexer loss": _over_batch_and_stages(vals, num_microbatches, total, grid).sum()
            / config.num_layers}


def mtp_losses(config, num_microbatches, total, grid, tracker):
    """{"mtp_<k> loss": device scalar} per depth k: the masked mean cross-entropy k tokens further ahead."""
    per_depth = tracker.values.pop("mtp loss", {})
    vals = torch.zeros(config.mtp_num_layers, device=ps.get_device())
    for k, value in per_depth.items():
        vals[k - 1] = value.to(vals.device)
    g = grid
    if g.cp > 1:
        dist.all_reduce(vals, group=g.cp_group)
    vals = _over_batch_and_stages(vals, num_microbatches, total, g)
    return {f"mtp_{k + 1} loss": v for k, v in enumerate(vals.unbind())}


def _over_batch_and_stages(vals, num_microbatches, total, g):
    """Per-layer sums over this rank's micro-batches -> averaged over the batch (total: this rank's
    loss divisor with uneven DP shares or micro-batch sizes, IterationPlan.total), summed over the
    pipeline stages (each holds its layers)."""
    vals = sum_over_data_parallel(vals / total, g) if total is not None else \
        average_over_data_parallel(vals / num_microbatches, g)
    if g.pp > 1:
        dist.all_reduce(vals, group=g.pp_group)
    return vals


def auxiliary_losses(config, num_microbatches, total, grid, tracker):
    """Every auxiliary loss of the log line (collective on every rank of `grid` when the model has any)."""
    out = {}
    if config.mtp_num_layers:
        out.update(mtp_losses(config, num_microbatches, total, grid, tracker))
    if config.experimental_attention_variant == "dsa":  # first: moe_losses clears every recorded value
        out.update(dsa_indexer_loss(config, num_microbatches, total, grid, tracker))
    if config.num_moe_experts:
        out.update(moe_losses(config, num_microbatches, total, grid, tracker))
    return out
