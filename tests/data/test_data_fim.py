"""Fill-in-the-middle samples (megalite/data/fim.py, pretrain_gpt.py --fim-data)."""

import numpy as np
import pytest

from megalite.data.fim import FIMDataset, fim_token_ids
from megalite.data.tokenizer import NullTokenizer, SentencePieceTokenizer
from megalite.data.tokenizer_training import train_sentencepiece

TOKENS = {"prefix": "<fim_prefix>", "middle": "<fim_middle>", "suffix": "<fim_suffix>", "pad": "<fim_pad>",
          "eod": "<EOD>"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory, corpus_texts):
    model = train_sentencepiece(corpus_texts, str(tmp_path_factory.mktemp("fimtok") / "tok"), vocab_size=400,
                                num_threads=1, fim_special_tokens=True)
    return SentencePieceTokenizer(model)


@pytest.fixture(scope="module")
def samples(tok, corpus_texts):
    """64 samples of 129 tokens, each a run of documents joined by <EOD> (some back to back)."""
    stream = []
    for t in corpus_texts:
        stream += tok.tokenize(t[:300]) + [tok.eod]
    stream = np.array(stream, dtype=np.int64)
    return [{"text": stream[i * 97:i * 97 + 129]} for i in range(64)]


def _dataset(tok, samples, **kw):
    args = dict(rate=1.0, spm_rate=0.0, seed=5)
    args.update(kw)
    return FIMDataset(samples, tok, fim_token_ids(tok, TOKENS), **args)


def _segments(a, eod):
    cuts = [-1] + [int(i) for i in np.flatnonzero(a == eod)] + [len(a)]
    return [a[x + 1:y] for x, y in zip(cuts, cuts[1:]) if y > x + 1]


def _unpermute(seg, ids, tok):
    """(prefix, middle, suffix) text of a FIM segment, and whether it was SPM."""
    p, m, s = ids["prefix"], ids["middle"], ids["suffix"]
    assert seg[0] == p, seg[:3]
    seg = list(seg)
    if seg[1] == s:  # SPM: <P> <S> suffix <M> prefix+middle (no marker between prefix and middle)
        j = seg.index(m)
        return None, tok.detokenize(seg[j + 1:]), tok.detokenize(seg[2:j]), True
    i, j = seg.index(s), seg.index(m)
    return tok.detokenize(seg[1:i]), tok.detokenize(seg[j + 1:]), tok.detokenize(seg[i + 1:j]), False


@pytest.mark.parametrize("spm", [0.0, 1.0])
def test_every_segment_is_rearranged_and_keeps_its_text(tok, samples, spm):
    ds, ids = _dataset(tok, samples, spm_rate=spm), fim_token_ids(tok, TOKENS)
    checked = 0
    for i in range(len(samples)):
        out, src = ds[i]["text"], samples[i]["text"]
        assert out.dtype == np.int64 and len(out) == len(src)
        if (out == ids["pad"]).any() or len(_segments(out, tok.eod)) != len(_segments(src, tok.eod)):
            continue  # the last segment was cut or padded to the sample's length
        for seg, orig in zip(_segments(out, tok.eod)[:-1], _segments(src, tok.eod)[:-1]):
            prefix, middle_or_pm, suffix, was_spm = _unpermute(seg, ids, tok)
            # (PSM with an empty prefix reads as SPM: <P> <S> suffix <M> middle either way)
            assert was_spm or not spm
            # the same characters in the same order; whitespace compared apart, since sentencepiece's
            # dummy prefix adds or drops a space where a piece starts with one
            text, squash = tok.detokenize(orig), lambda t: "".join(t.split())
            got = middle_or_pm + suffix if was_spm else prefix + middle_or_pm + suffix
            assert squash(got) == squash(text) and abs(len(got) - len(text)) <= 3
            checked += 1
    assert checked > 20, checked


def test_rate_zero_leaves_samples_alone_and_draws_are_per_sample(tok, samples):
    ds = _dataset(tok, samples, rate=0.0)
    assert all(np.array_equal(ds[i]["text"], samples[i]["text"]) for i in range(len(samples)))
    ds = _dataset(tok, samples, rate=0.5, spm_rate=0.5)
    forward = [ds[i]["text"] for i in range(len(samples))]
    backward = [ds[i]["text"] for i in reversed(range(len(samples)))][::-1]
    assert all(np.array_equal(a, b) for a, b in zip(forward, backward))  # order does not matter
    other = _dataset(tok, samples, rate=0.5, spm_rate=0.5, seed=6)
    assert any(not np.array_equal(a, other[i]["text"]) for i, a in enumerate(forward))


def test_rates_are_the_fractions_drawn(tok, samples):
    """rate 0.5 over every segment of 64 samples; binomial sd <= 0.5/sqrt(n): within 4 sd."""
    ids = fim_token_ids(tok, TOKENS)
    ds = _dataset(tok, samples, rate=0.5, spm_rate=0.5)
    fim = spm = total = 0
    for i in range(len(samples)):
        for seg in _segments(ds[i]["text"], tok.eod):
            total += 1
            if seg[0] == ids["prefix"]:
                fim += 1
                spm += int(len(seg) > 1 and seg[1] == ids["suffix"])
    assert total > 100 and abs(fim / total - 0.5) <= 4 * 0.5 / total ** 0.5, (fim, total)
    assert abs(spm / fim - 0.5) <= 4 * 0.5 / fim ** 0.5, (spm, fim)


def test_split_sample_and_no_prefix(tok):
    """Fragments around the split token are FIM'd alone; a fragment starting with --fim-no-prefix is kept."""
    ids = fim_token_ids(tok, TOKENS)
    split = tok.token_to_id("\n")
    a, b = tok.tokenize("def f(x): return x"), tok.tokenize("# keep me as I am")
    seq = np.array(a + [split] + b, dtype=np.int64)
    ds = FIMDataset([{"text": seq}], tok, ids, 1.0, 0.0, 0, split_sample="\n", fragment_rate=1.0, no_prefix="# keep")
    out = list(ds[0]["text"])
    cut = out.index(split)
    assert out[0] == ids["prefix"] and ids["suffix"] in out[:cut]  # the first fragment: PSM
    assert out[cut + 1:] == b[:len(out) - cut - 1]  # the second: untouched (cut back to the sample's length)


def test_missing_tokens_and_bad_flags_are_one_line(tok):
    with pytest.raises(ValueError, match="NullTokenizer has no token '<fim_prefix>' .--fim-prefix-token."):
        fim_token_ids(NullTokenizer(100), TOKENS)
    from megalite.cli.parser import parse_args
    req = "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --micro-batch-size 1 --lr 1e-3 " \
          "--train-iters 1".split()
    for bad, msg in ((["--fim-data", "--mock-data"], "does not compose with --mock-data"),
                     (["--fim-data", "--fim-rate", "1.5"], "--fim-rate 1.5: a rate is a probability"),
                     (["--fim-data", "--fim-split-sample", "x"], "needs --fim-fragment-rate")):
        with pytest.raises(SystemExit):
            parse_args(req + bad, world_size=1)


def test_pretrain_gpt_trains_on_fim_samples(tok, corpus_jsonl, tmp_path, capsys):
    """--fim-data through pretrain_gpt.py's data provider: the batches hold FIM samples, and training runs."""
    import pretrain_gpt
    from cli_batch import tool
    from megalite import parallel_state as ps
    from megalite.training import pretrain
    prefix = str(tmp_path / "fim")
    tool("preprocess_data").main(["--input", corpus_jsonl, "--output-prefix", prefix, "--tokenizer-type",
                                  "SentencePieceTokenizer", "--tokenizer-model", tok.model_file, "--append-eod",
                                  "--workers", "1"])
    from megalite.cli.parser import parse_args
    args = parse_args(("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 64 "
                       "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 2 --lr 1e-3 "
                       "--train-iters 2 --eval-iters 0 --log-interval 1 --fim-data --fim-rate 1 --fim-eod-token <EOD> "
                       f"--data-path {prefix}_text_document --tokenizer-type SentencePieceTokenizer "
                       f"--tokenizer-model {tok.model_file} --data-cache-path {tmp_path / 'cache'} --split 1,0,0 "
                       "--num-workers 0").split(), world_size=1)
    train, _, _ = pretrain_gpt.datasets_provider(args.draft(), (8, 0, 0))  # the provider's own copy
    assert sum(int((train[i]["text"] == tok.token_to_id("<fim_prefix>")).sum()) for i in range(8)) >= 8
    try:
        losses = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step, args)
    finally:
        ps.destroy_model_parallel()
    assert len(losses) == 2 and all(np.isfinite(losses))
