"""Pretrain a BERT with megalite: `torchrun --nproc-per-node N pretrain_bert.py [Megatron flags]`.

Masked-language modelling plus sentence-order prediction (`--bert-no-binary-head`: MLM only)
on sentence-split data (`tools/preprocess_data.py --split-sentences`). With no --data-path
it trains on the built-in default corpus split into sentences (the standard library's
sources, one line per sentence, with its own cached sentencepiece tokenizer), offline.
"""

import os

import torch
import torch.nn.functional as F

from megalite import parallel_state as ps
from megalite.parallel.grid import Grid
from megalite.cli.parser import parse_args
from megalite.distributed.cp_comm import cp_size, slice_for_cp_rank, sum_over_cp
from megalite.config import ConfigError
from megalite.models import BertModel

# As Megatron's pretrain_bert.py args_defaults: what makes the model a BERT, and its tokenizer default
ARGS_DEFAULTS = {"model_type": "bert", "tokenizer_type": "BertWordPieceLowerCase"}


def model_provider(config, pre_process=True, post_process=True, *, grid=None, vp_stage=None):
    return BertModel(config, pre_process=pre_process, post_process=post_process, grid=grid, vp_stage=vp_stage)


def datasets_provider(args, num_samples):
    from megalite.data import build_tokenizer
    from megalite.data.bert_dataset import build_bert_datasets

    builder, barrier = ps.global_rank() == 0, ps.barrier
    if args.mock_data:
        raise ConfigError("--mock-data is for GPT; BERT trains on --data-path (sentence-split) or, without it, "
                          "the default corpus")
    if not args.data_path:
        from megalite.data.default_corpus import prepare_default_corpus
        cache = args.data_cache_path or os.path.join(os.path.expanduser("~"), ".cache", "megalite")
        prefix, model_file = prepare_default_corpus(cache, is_builder=builder, barrier=barrier, sentences=True,
                                                    log=lambda m: builder and print(m, flush=True))
        args.data_path = [prefix]
        args.tokenizer_type, args.tokenizer_model = "SentencePieceTokenizer", model_file
    if args.tokenizer_type is None:
        raise ValueError("--data-path needs --tokenizer-type (SentencePieceTokenizer with --tokenizer-model, "
                         "BertWordPieceLowerCase/Case with --vocab-file, or HuggingFaceTokenizer)")
    model = args.vocab_file if args.tokenizer_type.startswith("BertWordPiece") else args.tokenizer_model
    tokenizer = build_tokenizer(args.tokenizer_type, model, args.vocab_size)
    args.vocab_size = tokenizer.vocab_size
    return build_bert_datasets(args.data_path, args.split, args.seq_length, args.seed, num_samples,
                               args.data_cache_path, tokenizer, args.mask_prob, args.short_seq_prob,
                               args.bert_binary_head, is_builder=builder, barrier=barrier)


def forward_step(data_iterator, model):
    """Megatron's contract: ((per-masked-token MLM loss, binary logits), loss_func). Every
    pipeline stage reads the batch: the padding mask is needed everywhere. Under context
    parallelism each rank keeps its two chunks of the tokens, types, labels and loss mask (the
    padding mask stays whole: it masks keys on every rank); the MLM loss is the mean over the
    whole sequence's masked tokens, and the sentence-order loss is CP rank 0's, which holds [CLS]."""
    b = next(data_iterator) if data_iterator is not None else {}
    # the layout the model was built in (a model called before any grid exists: one process's)
    grid = ps.grid_of([model]) if ps.model_parallel_is_initialized() else Grid.of()
    text, types, labels, loss_mask = (None if t is None else slice_for_cp_rank(t, 1, grid=grid) for t in (
        b.get("text"), b.get("types"), b.get("labels"), b.get("loss_mask")))
    output = model(text, b.get("padding_mask"), tokentype_ids=types, lm_labels=labels, loss_mask=loss_mask)
    cp = cp_size(grid) > 1

    def loss_func(out):
        per_token, binary_logits = out
        total = per_token.float().sum()
        count = torch.full((), float(max(per_token.numel(), 1)), device=total.device)
        whole = total.detach()
        if cp:  # the whole sequence's masked tokens; this rank's gradient is its part of the sum
            whole, count = sum_over_cp(torch.stack([whole, torch.full_like(count, per_token.numel())]), grid).unbind()
            count = count.clamp(min=1.0)
        lm_loss = total / count  # mean over the masked tokens
        lm_report = whole / count
        if binary_logits is None:
            return lm_loss, {"lm loss": lm_report}
        sop_loss = F.cross_entropy(binary_logits.float(), b["is_random"].view(-1))
        sop_report = sop_loss.detach()
        if cp:  # only CP rank 0's first row is [CLS]; the others' head still runs (the same collectives)
            sop_loss = sop_loss * float(ps.get_context_parallel_rank() == 0)
            sop_report = sum_over_cp(sop_loss.detach().clone(), grid)
        return lm_loss + sop_loss, {"lm loss": lm_report, "sop loss": sop_report}
    return output, loss_func


if __name__ == "__main__":
    args = parse_args(defaults=ARGS_DEFAULTS)  # a bad command line fails before the training stack is imported
    from megalite.training import pretrain
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    pretrain(datasets_provider, model_provider, forward_step, args=args)
