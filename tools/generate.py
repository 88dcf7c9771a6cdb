"""Generate text from a megalite GPT checkpoint (any saved topology), with a KV cache.

    python tools/generate.py --load ckpt --prompt "def main(" --max-new-tokens 40 --top-k 20
    torchrun --nproc-per-node 2 tools/generate.py --load ckpt --tensor-model-parallel-size 2 --greedy ...
    python tools/generate.py --load ckpt --prompt-ids "5 17 3" --greedy        # tokenizer-less checkpoints

The prompt is tokenized with the tokenizer recorded in the checkpoint (its type and model
file); the continuation is printed by rank 0.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite import parallel_state as ps  # noqa: E402
from megalite.checkpoint.storage import CheckpointError  # noqa: E402
from megalite.config import ConfigError, fail  # noqa: E402


def build_parser():
    p = argparse.ArgumentParser(description="Sample from a megalite GPT checkpoint", allow_abbrev=False)
    p.add_argument("--load", required=True, help="the checkpoint directory (as given to --save)")
    p.add_argument("--prompt", default=None, help="text, tokenized with the checkpoint's tokenizer")
    p.add_argument("--prompt-ids", default=None, help="space-separated token ids instead of text")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--greedy", action="store_true", help="always the most likely token")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set with mass p")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="under torchrun: = the world size")
    p.add_argument("--tokenizer-type", default=None, help="override the checkpoint's tokenizer")
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer / BertWordPiece: override the checkpoint's")
    p.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: override the checkpoint's")
    return p


def load_model(root, tp):
    from megalite.checkpoint.convert import find_checkpoint
    from megalite.checkpoint.manager import config_for_one_process, load_weights
    from megalite.models import GPTModel
    from megalite.tensor_parallel import model_parallel_manual_seed
    _, meta = find_checkpoint(root)
    saved = dict(meta["model_config"])
    if saved.get("model_type", "gpt") not in ("gpt", "GPT"):
        raise ConfigError(f"{root} holds a {saved['model_type']} model; tools/generate.py samples from GPT models")
    config = config_for_one_process(saved)
    ps.initialize_model_parallel(tp, 1)
    model_parallel_manual_seed(config.seed)
    model = GPTModel(config)
    load_weights([model], root)
    return model, meta


def main(argv=None):
    a = build_parser().parse_args(argv)
    try:
        if (a.prompt is None) == (a.prompt_ids is None):
            raise ConfigError("give exactly one of --prompt TEXT and --prompt-ids IDS")
        if a.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {a.max_new_tokens} must be >= 1")
        ps.initialize_distributed()
        if ps.world_size() != a.tensor_model_parallel_size:
            raise ConfigError(f"world size {ps.world_size()} must equal --tensor-model-parallel-size "
                              f"{a.tensor_model_parallel_size} (generation uses TP only)")
        if not os.path.isdir(a.load):
            raise ConfigError(f"--load {a.load} is not a directory")
        model, meta = load_model(a.load, a.tensor_model_parallel_size)
        vocab = model.config.vocab_size
        tok = None
        saved = meta.get("tokenizer") or {}
        ttype = a.tokenizer_type or saved.get("type")
        tmodel = a.tokenizer_model or saved.get("model")
        if a.prompt is not None:
            if not ttype:
                raise ConfigError(f"{a.load} records no tokenizer: pass --prompt-ids, or --tokenizer-type/-model")
            from megalite.data import build_tokenizer
            tok = build_tokenizer(ttype, tmodel, vocab - 1 if ttype == "NullTokenizer" else None,
                                  vocab_file=a.vocab_file or saved.get("vocab_file"),
                                  merge_file=a.merge_file or saved.get("merge_file"))
            ids = tok.tokenize(a.prompt)
        else:
            ids = [int(x) for x in a.prompt_ids.split()]
        if not ids or max(ids) >= vocab or min(ids) < 0:
            raise ConfigError(f"prompt token ids must be in [0, {vocab}) and not empty")
        limit = model.config.max_position_embeddings
        if model.config.position_embedding_type == "learned_absolute" and len(ids) + a.max_new_tokens > limit:
            raise ConfigError(f"prompt + --max-new-tokens = {len(ids) + a.max_new_tokens} exceeds the model's "
                              f"{limit} positions")
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        fail(str(e).splitlines()[0])
    from megalite.models.generation import generate
    out = generate(model, torch.tensor([ids], device=ps.get_device()), a.max_new_tokens, vocab,
                   use_cache=not a.no_kv_cache, eod=getattr(tok, "eod", None), seed=a.seed, greedy=a.greedy,
                   temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)[0].tolist()
    if ps.global_rank() == 0:
        new = out[len(ids):]
        print(tok.detokenize(out) if tok is not None else " ".join(map(str, out)), flush=True)
        print(f"generate: {len(new)} new tokens: {' '.join(map(str, new))}", flush=True)
    ps.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
