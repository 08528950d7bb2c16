"""RULER rules pinned to NVIDIA/RULER (revision in constants.RULER_REVISION) with small inputs."""

from __future__ import annotations

import importlib
import json

import pytest

from anchorctx.evaluation.ruler import constants as C
from anchorctx.evaluation.ruler import data as D
from anchorctx.evaluation.ruler import tasks as T

G = importlib.import_module("anchorctx.evaluation.ruler.generate")  # the package re-exports a
# function of the same name


class _WordTokenizer:
    """One token per whitespace-separated word: token counts the test can compute by hand."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return text.split()


class _StubBuilder(T.Builder):
    """``size`` words of haystack; sample ``index`` adds ``extra[index]`` words (its needles or
    documents tokenise longer), the way real samples differ from the probe sample 0."""

    min_size, probe = 1, 5

    def __init__(self, extra: dict[int, int]):
        self.extra = extra
        self.start = 40  # FWE only: where its upward search starts

    def build(self, size, index, rng):
        return T.Sample("w " * (size + self.extra.get(index, 0)), "", ["w"])


def _fitter(monkeypatch, task: str, length: int, extra: dict[int, int], fit: str = "ruler"):
    monkeypatch.setattr(G, "make_builder", lambda *a, **k: _StubBuilder(extra))
    return G._Fitter(task, length, _WordTokenizer(), 42, {}, fit)


def test_overflowing_sample_drops_whole_steps(monkeypatch):
    # niah: budget = 300 - 128 = 172 tokens; sample 0 fits 172 words. Sample 1 is 13 words
    # longer: RULER drops steps of `incremental` (5 here) until it fits: 172-15 = 157 + 13 = 170.
    f = _fitter(monkeypatch, "niah_single_1", 300, {1: 13, 2: 0})
    assert f.size == 172
    assert f.sample(0)["length"] == 300
    assert f.sample(1)["length"] - 128 == 157 + 13
    assert f.sample(2)["length"] == 300  # fits as is: keeps the searched size


def test_tight_fit_shrinks_to_largest_fitting(monkeypatch):
    f = _fitter(monkeypatch, "niah_single_1", 300, {1: 13}, fit="tight")
    assert f.sample(1)["length"] == 300  # 159 words + 13: exactly the budget


def test_fwe_size_rule(monkeypatch):
    # freq_words_extraction.py: from `start`, grow by `step` while tokens < max_len (strictly),
    # then one step back. Budget 400 - 50 = 350; from 40 in steps of 5 the first size with
    # tokens >= 350 is 350, so the size is 345 (not 350, which would fit exactly).
    f = _fitter(monkeypatch, "fwe", 400, {1: 12})
    assert f.size == 345
    assert f.sample(1)["length"] - 50 == 335 + 12  # 345+12 overflows: one step down


def test_fwe_vocabulary_and_steps():
    b = T.FWEBuilder(C.TASK_SPECS["fwe"].args, 4096, 42)
    max_len = 4096 - 50  # freq_words_extraction.py subtracts tokens_to_generate first
    assert (b.vocab_size, b.step, b.start) == (max_len // 50, max_len // 32, max_len // 6)
    assert (b.vocab_size, b.step, b.start) == (80, 126, 674)


def test_ruler_steps_per_family():
    # niah.py: 500 essay words, 25 lines (5 below 4K); variable_tracking.py: 10 (5 below 4K);
    # common_words_extraction.py and qa.py: 10.
    assert (
        T.NiahBuilder("niah_single_1", C.TASK_SPECS["niah_single_1"].args, 4096, 42, {}).step == 25
    )
    assert (
        T.NiahBuilder("niah_single_1", C.TASK_SPECS["niah_single_1"].args, 2048, 42, {}).step == 5
    )
    assert T.CWEBuilder(C.TASK_SPECS["cwe"].args, 4096, 42).step == 10


def test_vt_answer_prefix_is_current_ruler():
    assert "variables are assigned the value" in C.VT_ANSWER_PREFIX
    assert "assgined" not in C.VT_ANSWER_PREFIX + C.VT_TEMPLATE
    assert len(C.RULER_REVISION) == 40 and C.RULER_REVISION.startswith("c3f5e3b")


def test_cwe_uses_english_words_beyond_wonderwords(tmp_path):
    b = T.CWEBuilder(C.TASK_SPECS["cwe"].args, 131072, 42)
    n = len(b.words)
    assert b._pool(n) is b.words
    with pytest.raises(
        D.MissingDataError, match=r"evaluation\.ruler\.english_words_path is not set"
    ):
        b._pool(n + 1)
    words = {str(i): f"word{i}" for i in range(n + 50)}  # english_words.json: its values are words
    path = tmp_path / "english_words.json"
    path.write_text(json.dumps(words))
    b = T.CWEBuilder(C.TASK_SPECS["cwe"].args, 131072, 42, {"english_words_path": str(path)})
    assert b._pool(n + 1) == tuple(words.values()) and b.max_size == n + 50


def test_missing_punkt_model_is_a_clear_error(tmp_path):
    with pytest.raises(D.MissingSplitterError, match=r"punkt_tab.*python -m nltk\.downloader"):
        D.punkt_splitter(tmp_path / "no_nltk_data")


def test_punkt_model_read_from_configured_directory(tmp_path):
    from anchorctx.demo.fixtures import write_empty_punkt

    root = write_empty_punkt(tmp_path / "nltk_data")
    # An abbreviation learnt by the model keeps "Dr." inside its sentence: proof the files in
    # this directory are the ones used.
    (root / "tokenizers/punkt_tab/english/abbrev_types.txt").write_text("dr\n")
    split = D.punkt_splitter(root)
    assert split("We met Dr. Smith. He left.") == ["We met Dr. Smith.", "He left."]
