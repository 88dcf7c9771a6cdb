"""Pretrain a GPT with megalite: `torchrun --nproc-per-node N pretrain_gpt.py [Megatron flags]`.

With neither --data-path nor --mock-data it trains on the built-in default corpus (the
Python standard library's sources, tokenized with a sentencepiece model it trains once and
caches), so it runs offline on a fresh machine.
"""

import os

import torch

from megalite import parallel_state as ps
from megalite.models import GPTModel
from megalite.training import pretrain


def model_provider(config, pre_process=True, post_process=True):
    return GPTModel(config, pre_process=pre_process, post_process=post_process)


def _tokenizer(args):
    from megalite.data import build_tokenizer
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size, vocab_file=args.vocab_file,
                           merge_file=args.merge_file)


def datasets_provider(args, num_samples):
    from megalite.data import build_gpt_datasets
    from megalite.data.mock_dataset import MockGPTDataset

    builder, barrier = ps.global_rank() == 0, ps.barrier
    if args.mock_data:
        if args.tokenizer_type is not None:
            args.vocab_size = _tokenizer(args).vocab_size
        return tuple(MockGPTDataset(n, args.seq_length, args.vocab_size, args.seed, split_id=i)
                     for i, n in enumerate(num_samples))
    if not args.data_path:
        from megalite.data.default_corpus import prepare_default_corpus
        cache = args.data_cache_path or os.path.join(os.path.expanduser("~"), ".cache", "megalite")
        prefix, model_file = prepare_default_corpus(cache, is_builder=builder, barrier=barrier,
                                                    log=lambda m: builder and print(m, flush=True))
        args.data_path = [prefix]
        args.tokenizer_type, args.tokenizer_model = "SentencePieceTokenizer", model_file
    if args.tokenizer_type is None:
        raise ValueError("--data-path needs --tokenizer-type (and --tokenizer-model or --vocab-size)")
    args.vocab_size = _tokenizer(args).vocab_size
    return build_gpt_datasets(args.data_path, args.split, args.seq_length, args.seed, num_samples,
                              args.data_cache_path, is_builder=builder, barrier=barrier)


def forward_step(data_iterator, model):
    """Megatron's contract: (per-token loss, loss_func)."""
    tokens = labels = None
    if data_iterator is not None:  # middle pipeline stages read no data
        text = next(data_iterator)["text"]
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    output = model(tokens, labels=labels)

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach()}
    return output, loss_func


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    pretrain(datasets_provider, model_provider, forward_step)
