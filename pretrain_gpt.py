"""Pretrain a GPT with megalite: `torchrun --nproc-per-node N pretrain_gpt.py [Megatron flags]`.

With neither --data-path nor --mock-data it trains on the built-in default corpus (the
Python standard library's sources, tokenized with a sentencepiece model it trains once and
caches), so it runs offline on a fresh machine.
"""

import os

import torch

from megalite import parallel_state as ps
from megalite.parallel.grid import Grid
from megalite.distributed.cp_comm import cp_size, slice_for_cp_rank, sum_over_cp
from megalite.models import GPTModel


def model_provider(config, pre_process=True, post_process=True, *, grid=None, vp_stage=None):
    return GPTModel(config, pre_process=pre_process, post_process=post_process, grid=grid, vp_stage=vp_stage)


def _tokenizer(args):
    from megalite.data import build_tokenizer
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size, vocab_file=args.vocab_file,
                           merge_file=args.merge_file)


def datasets_provider(args, num_samples):
    from megalite.data import build_gpt_datasets, build_gpt_datasets_per_split
    from megalite.data.mock_dataset import MockGPTDataset

    from megalite.config.data import BatchMaskConfig, FimConfig
    from megalite.data.fim import with_fim
    from megalite.data.gpt_batch import with_batch_masks

    builder, barrier = ps.global_rank() == 0, ps.barrier
    if args.mock_data:
        eod = None
        if args.tokenizer_type is not None:
            tok = _tokenizer(args)
            args.vocab_size, eod = tok.vocab_size, tok.eod
        return with_batch_masks(tuple(MockGPTDataset(n, args.seq_length, args.vocab_size, args.seed, split_id=i)
                                      for i, n in enumerate(num_samples)), BatchMaskConfig.of(args), eod)
    split_paths = [args.train_data_path, args.valid_data_path, args.test_data_path]
    if not args.data_path and not any(split_paths):
        from megalite.data.default_corpus import prepare_default_corpus
        cache = args.data_cache_path or os.path.join(os.path.expanduser("~"), ".cache", "megalite")
        prefix, model_file = prepare_default_corpus(cache, is_builder=builder, barrier=barrier,
                                                    log=lambda m: builder and print(m, flush=True))
        args.data_path = [prefix]
        args.tokenizer_type, args.tokenizer_model = "SentencePieceTokenizer", model_file
    if args.tokenizer_type is None:
        raise ValueError("--data-path needs --tokenizer-type (and --tokenizer-model or --vocab-size)")
    tok = _tokenizer(args)
    args.vocab_size = tok.vocab_size
    if any(split_paths):  # (Megatron's --train/--valid/--test-data-path)
        datasets = build_gpt_datasets_per_split(split_paths, args.seq_length, args.seed, num_samples,
                                                args.data_cache_path, is_builder=builder, barrier=barrier)
    else:
        datasets = build_gpt_datasets(args.data_path, args.split, args.seq_length, args.seed, num_samples,
                                      args.data_cache_path, is_builder=builder, barrier=barrier)
    datasets = with_fim(datasets, FimConfig.of(args), tok)
    return with_batch_masks(datasets, BatchMaskConfig.of(args), tok.eod)


def forward_step(data_iterator, model):
    """Megatron's contract: (per-token loss, loss_func). The batch may carry Megatron's
    loss_mask / position_ids / attention_mask (megalite/data/gpt_batch.py); with a document
    mask every pipeline stage reads the batch (the model asks for it: input_on_every_stage).
    Under context parallelism each rank keeps its two chunks of every sequence (Megatron's
    get_batch_on_this_cp_rank) and the loss is the mean over the whole sequence's tokens."""
    tokens = labels = None
    b = next(data_iterator) if data_iterator is not None else {}  # middle stages may read nothing
    if "text" in b:
        tokens, labels = b["text"][:, :-1].contiguous(), b["text"][:, 1:].contiguous()
    # the layout the model was built in (a model called before any grid exists: one process's)
    grid = ps.grid_of([model]) if ps.model_parallel_is_initialized() else Grid.of()
    tokens, labels, position_ids, loss_mask = (None if t is None else slice_for_cp_rank(t, 1, grid=grid) for t in
                                               (tokens, labels, b.get("position_ids"), b.get("loss_mask")))
    output = model(tokens, position_ids=position_ids, labels=labels, attention_mask=b.get("attention_mask"),
                   loss_mask=loss_mask)
    per_token = getattr(model, "module", model).config.calculate_per_token_loss
    cp = cp_size(grid) > 1

    def loss_func(per_token_loss):
        losses = per_token_loss.float()
        if loss_mask is None and not per_token and not cp:
            loss = losses.mean()
            return loss, {"lm loss": loss.detach()}
        if loss_mask is None:
            total, count = losses.sum(), torch.full((), float(losses.numel()), device=losses.device)
        else:
            mask = loss_mask.to(losses.device, torch.float)
            total, count = (losses * mask).sum(), mask.sum()
        whole = total.detach()
        if cp:  # the whole sequence's sum and count; this rank's gradient is its part of the sum
            whole, count = sum_over_cp(torch.stack([whole, count]), grid).unbind()
        if per_token:  # Megatron: the schedule sums; gradients are divided by the batch's token count
            return total, count, {"lm loss": torch.stack([whole, count])}
        loss = total / count.clamp(min=1.0)  # as Megatron: a fully masked micro-batch gives 0, not NaN
        return loss, {"lm loss": whole / count.clamp(min=1.0) if cp else loss.detach()}
    return output, loss_func


if __name__ == "__main__":
    from megalite.cli.parser import parse_args
    args = parse_args()  # a bad command line fails here, before the training stack is imported
    from megalite.training import pretrain
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    pretrain(datasets_provider, model_provider, forward_step, args=args)
