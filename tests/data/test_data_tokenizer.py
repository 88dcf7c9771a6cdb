import ast
import importlib.util
import pathlib

import pytest

from megalite.data import build_tokenizer


def test_null_tokenizer_megatron_semantics():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.eod == 100 and tok.vocab_size == 101  # eod = --vocab-size = vocab_size - 1
    assert tok.tokenize("5 17 99") == [5, 17, 99] and tok.detokenize([5, 17]) == "5 17"
    assert tok.pad is None and tok.cls is None and tok.mask is None
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")


def test_sentencepiece_round_trip_and_specials(sp_model, corpus_texts):
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    text = corpus_texts[3][:2000] + "\n\n\tdef f(x):  # ünïcödé ✓\n        return x\n"
    ids = tok.tokenize(text)
    assert tok.detokenize(ids) == text  # lossless: whitespace, newlines, bytes all kept
    assert max(ids) < tok.vocab_size
    specials = {tok.eod, tok.pad, tok.cls, tok.sep, tok.mask}
    assert len(specials) == 5 and not specials & set(ids)
    # <EOD> is reserved inside the model; the BERT tokens were not, so they come after it.
    assert tok.eod < 600 and {tok.cls, tok.sep, tok.mask} == {600, 601, 602}
    assert tok.vocab_size == 603
    assert tok.detokenize([ids[0], tok.eod]).endswith("<EOD>")
    gpt = build_tokenizer("GPTSentencePieceTokenizer", sp_model)
    assert gpt.vocab_size == 600 and gpt.eod == 2 and gpt.tokenize(text) == ids


def test_tokenizer_errors_one_line(tmp_path):
    cases = [(("Bogus",), ValueError, "--tokenizer-type Bogus"),
             (("SentencePieceTokenizer", str(tmp_path / "x.model")), FileNotFoundError, "x.model"),
             (("SentencePieceTokenizer",), ValueError, "--tokenizer-model"),
             (("HuggingFaceTokenizer", str(tmp_path / "nodir")), FileNotFoundError, "nodir")]
    (tmp_path / "junk.model").write_text("not a model")
    cases.append((("SentencePieceTokenizer", str(tmp_path / "junk.model")), ValueError, "junk.model"))
    for args, exc, match in cases:
        with pytest.raises(exc) as e:
            build_tokenizer(*args)
        assert match in str(e.value) and "\n" not in str(e.value)


def test_huggingface_without_transformers(tmp_path):
    if importlib.util.find_spec("transformers") is not None:
        pytest.skip("transformers is installed; this checks the message when it is not")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'megalite\[hf\]'"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


def test_data_package_imports_no_distributed_or_megalite():
    """megalite.data sits low in the dependency order: numpy/sentencepiece/datasets only."""
    root = pathlib.Path(__file__).resolve().parents[2] / "megalite" / "data"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            for name in names:
                assert not name.startswith(("torch", "megalite")), f"{path.name} imports {name}"
