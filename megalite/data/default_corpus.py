"""The built-in corpus for runs without --data-path: the running interpreter's standard
library `.py` sources (one document per file, sorted by path, test suites left out: ~12 MB,
~3.6M tokens), a sentencepiece BPE tokenizer trained on them, and the Megatron-format
dataset, all cached under `cache_dir` so that a second call returns at once."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from typing import Callable

from .indexed_dataset import dataset_exists
from .preprocess import PreprocessConfig, preprocess_dataset
from .tokenizer_training import train_sentencepiece

FORMAT_VERSION = 1
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
PREFIX_NAME = "stdlib_text_document"
MODEL_NAME = "tokenizer.model"


def stdlib_sources(max_files: int | None = None) -> list[str]:
    """Sorted paths of the standard library's .py files (without test suites)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _SKIP_DIRS]
        files += [os.path.join(d, n) for n in names if n.endswith(".py")]
    files.sort(key=lambda p: os.path.relpath(p, root))
    return files[:max_files] if max_files else files


def corpus_dir(cache_dir: str, vocab_size: int, max_files: int | None, sentences: bool = False) -> str:
    files = stdlib_sources(max_files)
    key = json.dumps({"v": FORMAT_VERSION, "python": sys.version, "stdlib": sysconfig.get_paths()["stdlib"],
                      "files": len(files), "bytes": sum(os.path.getsize(f) for f in files),
                      "vocab_size": vocab_size})
    digest = hashlib.md5(key.encode()).hexdigest()[:10]
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}-v{vocab_size}" + (f"-n{max_files}" if max_files else "") \
        + ("-sentences" if sentences else "")
    return os.path.join(os.path.abspath(cache_dir), f"default_corpus-{tag}-{digest}")


def _outputs(path: str, sentences: bool = False) -> tuple[str, str]:
    prefix = PREFIX_NAME.replace("_document", "_sentence") if sentences else PREFIX_NAME
    return os.path.join(path, prefix), os.path.join(path, MODEL_NAME)


def _is_complete(path: str, sentences: bool = False) -> bool:
    prefix, model = _outputs(path, sentences)
    return os.path.isfile(os.path.join(path, "stats.json")) and os.path.isfile(model) \
        and dataset_exists(prefix)


def _build(final: str, vocab_size: int, max_files: int | None, workers: int, log, sentences: bool = False) -> None:
    tmp = f"{final}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _build_in(tmp, vocab_size, max_files, workers, log, sentences)
        os.replace(tmp, final)  # atomic: readers see all of it or nothing
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"default corpus: built in {final}")


def _build_in(tmp: str, vocab_size: int, max_files: int | None, workers: int, log, sentences: bool = False) -> None:
    import datasets  # real HF datasets path, in memory: no JSON round trip needed

    t0 = time.perf_counter()
    files = stdlib_sources(max_files)
    texts = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
    log(f"default corpus: {len(files)} standard-library files, {sum(map(len, texts)) / 1e6:.1f} MB "
        f"from {sysconfig.get_paths()['stdlib']}")
    model = train_sentencepiece(texts, os.path.join(tmp, MODEL_NAME[:-len(".model")]),
                                vocab_size=vocab_size, model_type="bpe", bert_special_tokens=True,
                                input_sentence_size=400_000)
    t1 = time.perf_counter()
    ds = datasets.Dataset.from_dict({"text": texts, "path": files})
    cfg = PreprocessConfig(json_keys=["text"], tokenizer_type="SentencePieceTokenizer",
                           tokenizer_model=model, append_eod=True, workers=workers, log_interval=0,
                           split_sentences=sentences, sentence_splitter="lines")
    stats = preprocess_dataset(ds, os.path.join(tmp, "stdlib"), cfg)
    stats.update(tokenizer_seconds=t1 - t0, total_seconds=time.perf_counter() - t0, files=len(files))
    stats.pop("prefixes")
    with open(os.path.join(tmp, "stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    log(f"default corpus: {stats['documents']} documents, {stats['tokens']} tokens, vocab {vocab_size}, "
        f"{stats['total_seconds']:.1f} s")


def prepare_default_corpus(cache_dir: str, is_builder: bool = True,
                           barrier: Callable[[], None] = lambda: None, vocab_size: int = 8192,
                           max_files: int | None = None, workers: int = 1,
                           log: Callable[[str], None] = print, sentences: bool = False) -> tuple[str, str]:
    """Return (data_prefix, tokenizer_model), building them first if needed. Only the
    builder builds (under a file lock, so separate jobs sharing cache_dir don't collide);
    every caller passes `barrier` exactly once, the others then check the result.
    workers=1 tokenizes in-process: ~3 s here, and no fork of a process running torch.
    sentences=True (BERT): each non-blank line is a sentence, in its own cache directory with
    its own tokenizer."""
    path = corpus_dir(cache_dir, vocab_size, max_files, sentences)
    error = None
    if is_builder and not _is_complete(path, sentences):
        try:
            os.makedirs(cache_dir, exist_ok=True)
            with open(os.path.join(cache_dir, ".default_corpus.lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not _is_complete(path, sentences):  # another job may have built it meanwhile
                    shutil.rmtree(path, ignore_errors=True)
                    _build(path, vocab_size, max_files, workers, log, sentences)
        except Exception as exc:  # meet the others at the barrier first, then raise
            error = exc
    barrier()
    if error is not None:
        raise error
    if not _is_complete(path, sentences):
        raise RuntimeError(f"default corpus missing in {path}: the building rank failed or does "
                           f"not share this directory; point the cache at a shared path")
    return _outputs(path, sentences)
