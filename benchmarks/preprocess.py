"""Preprocessing throughput: `tools/preprocess_data.py --workers W` on the default corpus
(the standard library's .py sources as JSON lines) against raw sentencepiece encoding of
the same documents in one process. Prints a table; the goal is a per-worker-core ratio
>= 0.8, i.e. the pipeline (HF datasets reading, worker pool, numpy packing, writing the
.bin/.idx) costs at most 20% on top of the tokenizer itself.

Second table: GPT2BPETokenizer (byte-level BPE through `tokenizers`, Rust) against the same
BPE run as a Python loop (the algorithm of Megatron's retired gpt2_tokenization.py and of
transformers < 5's slow GPT2Tokenizer; transformers 5 has no slow GPT-2 tokenizer left),
on a GPT-2-sized vocabulary trained on the corpus, plus preprocess_data.py with it.

    python benchmarks/preprocess.py [--workers 2] [--repeats 3] [--cache-dir DIR] [--gpt2-only]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megalite.data.default_corpus import prepare_default_corpus, stdlib_sources  # noqa: E402


def raw_encode(model: str, texts: list[str]) -> tuple[int, float]:
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=model)
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for t in texts:
        n += len(sp.EncodeAsIds(t))
    return n, time.perf_counter() - t0, time.process_time() - c0


_TEXTS: list[str] = []


def _encode_share(args) -> int:
    import sentencepiece as spm
    model, lo, hi = args
    sp = spm.SentencePieceProcessor(model_file=model)
    return sum(len(sp.EncodeAsIds(t)) for t in _TEXTS[lo:hi])


def raw_encode_parallel(model: str, texts: list[str], workers: int) -> tuple[int, float]:
    """The ceiling for W workers on this machine as it is loaded right now: raw encoding in
    W forked processes, each given an equal share of the characters."""
    import multiprocessing as mp
    import numpy as np
    _TEXTS[:] = texts
    cum = np.cumsum([len(t) for t in texts])
    cuts = [0] + [int(np.searchsorted(cum, cum[-1] * k / workers)) for k in range(1, workers)] + [len(texts)]
    t0 = time.perf_counter()
    with mp.get_context("fork").Pool(workers) as pool:
        n = sum(pool.map(_encode_share, [(model, cuts[k], cuts[k + 1]) for k in range(workers)]))
    return n, time.perf_counter() - t0


def run_preprocess(jsonl: str, model: str, out: str, workers: int,
                   tokenizer: list[str] | None = None) -> tuple[int, float, float, float]:
    tokenizer = tokenizer or ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model]
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", jsonl,
           "--json-keys", "text", *tokenizer, "--output-prefix", out, "--workers", str(workers),
           "--log-interval", "0"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    m = re.search(r"Done: (\d+) documents, (\d+) tokens in ([\d.]+) s.*; ([\d,]+) tokens per CPU", r.stdout)
    n = int(m.group(2))
    return n, float(m.group(3)), wall, n / int(m.group(4).replace(",", ""))


def gpt2_files(cache_dir: str, texts: list[str]) -> tuple[str, str]:
    """A GPT-2-layout vocab.json (<|endoftext|> last) + merges.txt trained on the corpus, cached."""
    import hashlib
    from tokenizers import ByteLevelBPETokenizer
    key = hashlib.md5(json.dumps([len(texts), sum(map(len, texts)), 50256]).encode()).hexdigest()[:10]
    d = os.path.join(cache_dir, f"gpt2_bpe-{key}")
    vocab, merges = os.path.join(d, "vocab.json"), os.path.join(d, "merges.txt")
    if not os.path.exists(vocab):
        os.makedirs(d, exist_ok=True)
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(texts, vocab_size=50256, min_frequency=1, show_progress=False)
        bpe.save_model(d)
        v = json.load(open(vocab, encoding="utf-8"))
        v["<|endoftext|>"] = len(v)
        with open(vocab + ".tmp", "w", encoding="utf-8") as f:
            json.dump(v, f, ensure_ascii=False)
        os.replace(vocab + ".tmp", vocab)
    return vocab, merges


def _timed(fn, texts):
    t0, c0 = time.perf_counter(), time.process_time()
    ids = fn(texts)
    return ids, time.perf_counter() - t0, time.process_time() - c0


def gpt2_table(texts: list[str], jsonl: str, tmp: str, args) -> None:
    from megalite.data.tokenizer import build_tokenizer
    from megalite.data.tokenizer_bpe import PythonGPT2BPE
    vocab, merges = gpt2_files(args.cache_dir, texts)
    fresh = lambda: build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)  # noqa: E731
    # The Python loop gets a share of the corpus (every k-th file) to keep the run short.
    sub = texts[::args.python_every]
    cases = {  # name: (documents, encode given a fresh tokenizer: caches start cold in every run)
        f"Python BPE loop, every {args.python_every}th doc": (sub, lambda: (
            lambda py: lambda ts: [py.tokenize(t) for t in ts])(PythonGPT2BPE(vocab, merges))),
        "GPT2BPETokenizer.tokenize, same docs": (sub, lambda: (
            lambda tok: lambda ts: [tok.tokenize(t) for t in ts])(fresh())),
        "GPT2BPETokenizer.tokenize, all docs": (texts, lambda: (
            lambda tok: lambda ts: [tok.tokenize(t) for t in ts])(fresh())),
        "GPT2BPETokenizer.tokenize_batch (encode_batch), all docs": (texts, lambda: fresh().tokenize_batch),
    }
    gpt2_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    best, pre = {}, []
    for _ in range(args.repeats):  # interleaved, so that load from other jobs hits every case
        for name, (docs, make) in cases.items():
            ids, wall, cpu = _timed(make(), docs)
            old = best.get(name)
            best[name] = (ids, min(wall, old[1]) if old else wall, min(cpu, old[2]) if old else cpu)
        pre.append(run_preprocess(jsonl, "", os.path.join(tmp, "gpt2"), args.workers, gpt2_flags))
    names = list(cases)
    assert best[names[0]][0] == best[names[1]][0]  # the same ids from both implementations
    assert best[names[2]][0] == best[names[3]][0]
    n_tokens = sum(map(len, best[names[2]][0]))
    assert pre[0][0] == n_tokens, (pre[0][0], n_tokens)
    rows = {}
    for name, (docs, _) in cases.items():
        ids, wall, cpu = best[name]
        mb = sum(len(t.encode("utf-8")) for t in docs) / 1e6
        rows[name] = (len(docs) / wall, mb / wall, mb / cpu, sum(map(len, ids)) / wall)
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    t_pre, cpu_pre = min(x[1] for x in pre), min(x[3] for x in pre)
    rows[f"preprocess_data.py GPT2BPETokenizer --workers {args.workers} (tokenize + write)"] = (
        len(texts) / t_pre, mb / t_pre, mb / cpu_pre, n_tokens / t_pre)
    print(f"\nGPT-2 byte-level BPE: vocab {fresh().vocab_size} (trained on the corpus, GPT-2 layout); "
          f"Python loop on {len(sub)} of {len(texts)} documents; cold caches; best of {args.repeats}")
    print(f"| {'measurement':<66} | {'docs/s':>8} | {'MB/s':>6} | {'MB/CPU-s':>8} | {'tokens/s':>10} |")
    print(f"|{'-' * 68}|{'-' * 10}|{'-' * 8}|{'-' * 10}|{'-' * 12}|")
    for name, (d, m, c, t) in rows.items():
        print(f"| {name:<66} | {d:>8,.1f} | {m:>6.2f} | {c:>8.2f} | {t:>10,.0f} |")
    py, rs, batch = rows[names[0]], rows[names[1]], rows[names[3]]
    print(f"GPT2BPETokenizer / Python BPE loop on the same documents: {rs[1] / py[1]:.1f}x wall, "
          f"{rs[2] / py[2]:.1f}x per CPU-second; tokenize_batch on all documents: {batch[1] / py[1]:.1f}x wall "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs; best of each is kept")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "megalite_bench_cache"))
    p.add_argument("--gpt2-only", action="store_true", help="only the GPT2BPETokenizer table")
    p.add_argument("--python-every", type=int, default=8, help="Python BPE loop: every k-th document")
    args = p.parse_args()

    _, model = prepare_default_corpus(args.cache_dir)
    files = stdlib_sources()
    texts = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "stdlib.jsonl")
        with open(jsonl, "w") as f:
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
        run_preprocess(jsonl, model, os.path.join(tmp, "warm"), args.workers)  # HF cache warm-up
        if args.gpt2_only:
            return gpt2_table(texts, jsonl, tmp, args)
        raw, pre, par = [], [], []
        for _ in range(args.repeats):  # alternate so that load from other jobs hits both
            raw.append(raw_encode(model, texts))
            par.append(raw_encode_parallel(model, texts, args.workers))
            pre.append(run_preprocess(jsonl, model, os.path.join(tmp, "out"), args.workers))
    n_raw, t_raw, _ = min(raw, key=lambda x: x[1])
    n_pre, t_pre, wall, _ = min(pre, key=lambda x: x[1])
    assert n_raw == n_pre, (n_raw, n_pre)  # same documents, same tokens
    raw_tps, pre_tps, e2e_tps = n_raw / t_raw, n_pre / t_pre, n_pre / wall
    ratio = pre_tps / (args.workers * raw_tps)
    par_tps = n_raw / min(x[1] for x in par)
    raw_cpu = n_raw / min(x[2] for x in raw)
    pre_cpu = n_pre / min(x[3] for x in pre)
    mb = sum(map(len, texts)) / 1e6
    print(f"corpus: {len(texts)} documents, {mb:.1f} MB, {n_raw:,} tokens; cores: {os.cpu_count()}; "
          f"best of {args.repeats}")
    print(f"| {'measurement':<60} | {'tokens/s':>12} |")
    print(f"|{'-' * 62}|{'-' * 14}|")
    print(f"| {'raw sentencepiece EncodeAsIds, 1 process':<60} | {raw_tps:>12,.0f} |")
    print(f"| {f'raw sentencepiece, {args.workers} forked processes (ceiling)':<60} | {par_tps:>12,.0f} |")
    print(f"| {f'preprocess_data.py --workers {args.workers} (tokenize + write)':<60} | {pre_tps:>12,.0f} |")
    print(f"| {f'preprocess_data.py --workers {args.workers} end to end (wall)':<60} | {e2e_tps:>12,.0f} |")
    print(f"| {'raw sentencepiece, per CPU-second':<60} | {raw_cpu:>12,.0f} |")
    print(f"| {f'preprocess_data.py --workers {args.workers}, per CPU-second (all procs)':<60} | {pre_cpu:>12,.0f} |")
    print(f"per-worker-core ratio (wall): {ratio:.2f} (preprocess / ({args.workers} x raw); goal >= 0.8)")
    print(f"preprocess / raw in {args.workers} processes: {pre_tps / par_tps:.2f} (the pipeline's own cost "
          f"at the CPU share this machine gives now)")
    print(f"per-worker-core ratio (CPU time): {pre_cpu / raw_cpu:.2f} (independent of other load; "
          f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"end-to-end wall {wall:.2f} s includes interpreter start, imports and reading the "
          f"JSON lines through datasets")
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "stdlib.jsonl")
        with open(jsonl, "w") as f:
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
        gpt2_table(texts, jsonl, tmp, args)


if __name__ == "__main__":
    main()
