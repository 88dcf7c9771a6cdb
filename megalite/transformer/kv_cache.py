"""The key/value cache of generation (megalite/models/generation.py): each attention layer reuses the keys and
values of earlier positions; under TP each rank caches its own heads."""

import torch


class KVCache:
    """Keys and values per attention module, [b, positions, groups, d]; `offset` counts the
    positions cached so far (the model advances it after each forward)."""

    def __init__(self):
        self.kv, self.offset = {}, 0

    def extend(self, key, k, v):
        """Append this step's k, v; returns all of them and the attention mask for this step's
        queries (None: plain causal, valid when nothing was cached before)."""
        if key in self.kv:
            pk, pv = self.kv[key]
            k, v = torch.cat([pk, k], dim=1), torch.cat([pv, v], dim=1)
        self.kv[key] = (k, v)
        if not self.offset:
            return k, v, None
        total = k.shape[1]
        q_pos = torch.arange(self.offset, total, device=k.device)[:, None]
        masked = torch.arange(total, device=k.device)[None, :] > q_pos  # True = not attended
        return k, v, masked[None, None]
