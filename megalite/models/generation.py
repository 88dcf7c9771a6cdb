"""Text generation: sampling (greedy, temperature, top-k, top-p) over a key/value cache
(megalite/transformer/kv_cache.py).

With a KVCache the model runs the prompt once, then one token per step, each attention
layer reusing the keys and values of earlier positions. Under TP each rank caches its own
heads; every TP rank samples from the same gathered logits with the same generator, so all
ranks pick the same token.
"""

import torch

from megalite.tensor_parallel import gather_from_tensor_model_parallel_region
from megalite.transformer.kv_cache import KVCache


def sample(logits, generator, greedy=False, temperature=1.0, top_k=0, top_p=1.0):
    """One token id per row of logits [b, V]."""
    if greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / max(temperature, 1e-5)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(model, prompt, max_new_tokens, vocab_size, use_cache=True, eod=None, seed=0, **sampling):
    """prompt: LongTensor [b, s]; returns [b, s + new] (stops early when every row hit eod)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    tokens, cache = prompt, (KVCache() if use_cache else None)
    step_input = prompt
    for _ in range(max_new_tokens):
        logits = model(step_input if use_cache else tokens, inference_cache=cache)[:, -1]
        logits = gather_from_tensor_model_parallel_region(logits)[:, :vocab_size]  # padding never sampled
        nxt = sample(logits, gen, **sampling)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        step_input = nxt[:, None]
        if eod is not None and bool((nxt == eod).all()):
            break
    return tokens
