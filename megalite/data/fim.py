"""Fill-in-the-middle samples (Megatron's --fim-data, the FIM paper's PSM / SPM formats).

A GPT sample (seq_length + 1 token ids) is cut at its end-of-document tokens; each segment,
with probability --fim-rate, is detokenized, cut at two random character positions into
prefix / middle / suffix, retokenized and rearranged as
    PSM: <prefix> P <suffix> S <middle> M        SPM (probability --fim-spm-rate): <prefix> <suffix> S <middle> P M
with the end-of-document tokens kept between segments; the sample is then cut or padded
(--fim-pad-token) back to its length. --fim-split-sample T: a segment is first split at
token T, and (with probability --fim-rate) each fragment is permuted with probability
--fim-fragment-rate; --fim-no-prefix S: a fragment whose text starts with S is left alone.

Unlike Megatron, whose one random stream per dataset makes a sample depend on the order
samples were read in, sample i draws from a stream seeded by (seed, i): the same sample
whatever the order, the DataLoader workers or a resume.
"""

import numpy as np

TOKEN_FLAGS = (("prefix", "--fim-prefix-token"), ("middle", "--fim-middle-token"), ("suffix", "--fim-suffix-token"),
               ("pad", "--fim-pad-token"), ("eod", "--fim-eod-token"))


def fim_token_ids(tokenizer, tokens):
    """{name: id} of the five FIM tokens ({name: text}); one line naming a missing one."""
    ids = {}
    for name, flag in TOKEN_FLAGS:
        i = tokenizer.token_to_id(tokens[name])
        if i is None:
            raise ValueError(f"--fim-data: {type(tokenizer).__name__} has no token {tokens[name]!r} ({flag}); use a "
                             "tokenizer whose vocabulary holds the FIM tokens, or name its tokens with the flag")
        ids[name] = int(i)
    return ids


class FIMDataset:
    """`dataset[i]` of a GPT dataset with its "text" rearranged as above."""

    def __init__(self, base, tokenizer, ids, rate, spm_rate, seed, split_sample=None, fragment_rate=None,
                 no_prefix=None):
        self.base, self.tokenizer, self.ids = base, tokenizer, ids
        self.rate, self.spm_rate, self.seed = rate, spm_rate, seed
        self.split = None if split_sample is None else _single_id(tokenizer, split_sample)
        self.fragment_rate, self.no_prefix = fragment_rate, no_prefix

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        item = dict(self.base[i])
        rng = np.random.RandomState([self.seed & 0xFFFFFFFF, int(i) % len(self.base)])
        item["text"] = self.transform(item["text"], rng)
        return item

    def transform(self, sample, rng):
        eod, n = self.ids["eod"], len(sample)
        parts, start = [], 0
        for stop in [int(j) for j in np.flatnonzero(sample == eod)] + [n]:
            if stop > start:
                parts.append(self._segment(sample[start:stop], rng))
            if stop < n:
                parts.append(np.array([eod], dtype=np.int64))
            start = stop + 1
        out = np.concatenate(parts) if parts else sample
        if len(out) < n:
            out = np.concatenate([out, np.full(n - len(out), self.ids["pad"], dtype=np.int64)])
        return out[:n].astype(np.int64)

    def _segment(self, seq, rng):
        if self.split is None or not (seq == self.split).any():
            return self._permute(seq, self.rate, rng)
        if not rng.binomial(1, self.rate):
            return seq
        parts, start = [], 0
        for stop in [int(j) for j in np.flatnonzero(seq == self.split)] + [len(seq)]:
            if stop > start:
                parts.append(self._permute(seq[start:stop], self.fragment_rate, rng))
            if stop < len(seq):
                parts.append(np.array([self.split], dtype=np.int64))
            start = stop + 1
        return np.concatenate(parts)

    def _permute(self, seq, rate, rng):
        if not rng.binomial(1, rate):
            return seq
        text = self.tokenizer.detokenize(seq)
        if self.no_prefix is not None and text.startswith(self.no_prefix):
            return seq
        a, b = sorted(rng.randint(0, len(text) + 1, size=2))
        enc = self.tokenizer.tokenize
        prefix, middle, suffix = (np.array(enc(t), dtype=np.int64) for t in (text[:a], text[a:b], text[b:]))
        p, m, s = ([self.ids[k]] for k in ("prefix", "middle", "suffix"))
        if rng.binomial(1, self.spm_rate):
            return np.concatenate([p, s, suffix, m, prefix, middle]).astype(np.int64)
        return np.concatenate([p, prefix, s, suffix, m, middle]).astype(np.int64)


def _single_id(tokenizer, token):
    i = tokenizer.token_to_id(token)
    if i is None:
        raise ValueError(f"--fim-split-sample {token!r}: not one token of {type(tokenizer).__name__}'s vocabulary")
    return int(i)


def with_fim(datasets, cfg, tokenizer):
    """Wrap (train, valid, test) for --fim-data (else unchanged); cfg: the FimConfig (config/data.py)."""
    if not cfg.fim_data:
        return datasets
    ids = fim_token_ids(tokenizer, {name: getattr(cfg, f"fim_{name}_token") for name, _ in TOKEN_FLAGS})
    return tuple(None if d is None else FIMDataset(d, tokenizer, ids, cfg.fim_rate, cfg.fim_spm_rate,
                                                   cfg.seed + k, cfg.fim_split_sample, cfg.fim_fragment_rate,
                                                   cfg.fim_no_prefix)
                 for k, d in enumerate(datasets))
