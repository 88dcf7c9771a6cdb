"""Reading user text through Hugging Face `datasets` (local files only): `load_dataset` for
json/jsonl/parquet/csv/text files (or globs of them), `load_from_disk` for a saved dataset."""

from __future__ import annotations

import glob
import os

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv",
            ".txt": "text", ".text": "text"}


class InputError(ValueError):
    """A problem with the user's input; the CLIs print it as one line."""


def _quiet_datasets():
    import datasets
    datasets.disable_progress_bars()
    # datasets logs parse failures itself before raising; we report them as one line.
    datasets.utils.logging.set_verbosity(datasets.logging.CRITICAL + 10)
    return datasets


def _builder_for(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path
    ext = os.path.splitext(name)[1].lower()
    if ext not in BUILDERS:
        raise InputError(f"--input {path}: unknown file type {ext or '(none)'!r}; use .json/.jsonl, "
                         f".parquet, .csv, .txt or a directory saved with Dataset.save_to_disk")
    return BUILDERS[ext]


def _first_line(exc: BaseException) -> str:
    while exc.__cause__ is not None or (exc.__context__ is not None and not str(exc)):
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def load_text_dataset(input_path: str, cache_dir: str | None = None):
    """Return a `datasets.Dataset`. Raises InputError (one line) for anything the user
    can fix: missing or empty file, unknown type, unreadable content."""
    if os.path.isdir(input_path):
        datasets = _quiet_datasets()
        try:
            ds = datasets.load_from_disk(input_path)
        except Exception as exc:
            raise InputError(f"--input {input_path}: not a directory saved with save_to_disk "
                             f"({_first_line(exc)})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" in ds:
                ds = ds["train"]
            elif len(ds) == 1:
                ds = next(iter(ds.values()))
            else:
                raise InputError(f"--input {input_path}: a DatasetDict with splits {list(ds)}; "
                                 f"save the split you want on its own")
    else:
        files = sorted(glob.glob(input_path)) if glob.has_magic(input_path) else [input_path]
        if not files or not all(os.path.isfile(f) for f in files):
            missing = next((f for f in files if not os.path.isfile(f)), input_path)
            raise InputError(f"--input {missing}: file not found")
        builders = {_builder_for(f) for f in files}
        if len(builders) > 1:
            raise InputError(f"--input {input_path}: mixes file types {sorted(builders)}")
        if all(os.path.getsize(f) == 0 for f in files):
            raise InputError(f"--input {input_path}: empty input (0 bytes); nothing to process")
        datasets = _quiet_datasets()
        try:
            ds = datasets.load_dataset(builders.pop(), data_files=files, split="train",
                                       cache_dir=cache_dir)
        except Exception as exc:
            raise InputError(f"--input {input_path}: could not be read ({_first_line(exc)})") from None
    if len(ds) == 0:
        raise InputError(f"--input {input_path}: empty input (no documents); nothing to process")
    return ds


def check_keys(ds, keys: list[str], input_path: str) -> None:
    for key in keys:
        if key not in ds.column_names:
            raise InputError(f"--json-keys {key}: no such field in {input_path} "
                             f"(fields: {', '.join(ds.column_names)})")


def iter_texts(ds, keys: list[str], batch: int = 1024):
    """Yield every non-empty string of the given columns (documents in order)."""
    for start in range(0, len(ds), batch):
        rows = ds[start:start + batch]
        for key in keys:
            for text in rows[key]:
                if text:
                    yield text if isinstance(text, str) else str(text)
