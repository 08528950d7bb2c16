"""RULER metrics on hand-made predictions."""

from __future__ import annotations

import pytest

from anchorctx.evaluation.ruler import (
    PAPER_EXCLUDE,
    clean_prediction,
    mean_over_tasks,
    sample_score,
    score,
)


def test_string_match_all_is_share_of_references():
    refs = [["1234567", "7654321", "1111111", "2222222"], ["ABCDE"]]
    preds = [" 1234567, 7654321 and 2222222.", "the answer: abcde"]  # 3/4 and 1/1, any case
    assert score("niah_multivalue", preds, refs) == pytest.approx((75.0 + 100.0) / 2)
    assert score("vt", ["", "nothing"], refs) == 0.0


def test_string_match_part_any_alias():
    """qa: one alias found scores the whole sample (lm-eval 0.4.13 averages aliases instead)."""
    refs = [["Denver Broncos", "The Broncos", "Broncos"], ["Paris"]]
    assert score("qa_1", ["broncos", "London"], refs) == 50.0
    assert score("qa_2", ["The Denver Broncos won", "paris"], refs) == 100.0
    assert sample_score("qa_1", "Broncos", refs[0]) == 100.0
    assert sample_score("niah_multikey_1", "Broncos", refs[0]) == pytest.approx(100 / 3)


def test_control_characters_cleaned_before_matching():
    assert clean_prediction("  A\x00B\tC\n ") == "A\nB\nC"
    # a control character inside a reference-sized span breaks the match, as in RULER
    assert sample_score("niah_single_1", "12\x0134567", ["1234567"]) == 0.0
    assert sample_score("niah_single_1", "\x02 1234567 \x03", ["1234567"]) == 100.0


def test_score_checks_shapes():
    with pytest.raises(ValueError, match="2 predictions for 1"):
        score("fwe", ["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="no predictions"):
        score("fwe", [], [])
    with pytest.raises(ValueError, match="at least one reference"):
        score("cwe", ["a"], [[]])


def test_mean_over_tasks_and_paper_exclusion():
    scores = {
        "niah_single_1": {"4096": 100.0, "8192": 90.0},
        "niah_multikey_3": {"4096": 40.0, "8192": 20.0},
        "cwe": {"4096": 10.0, "8192": 0.0},
        "qa_1": {"4096": 50.0},  # not run at 8K: 8K is left out rather than averaged over 3
    }
    assert mean_over_tasks(scores) == {"4096": 50.0}
    assert PAPER_EXCLUDE == ("niah_multikey_3", "cwe")
    assert mean_over_tasks(scores, exclude=PAPER_EXCLUDE) == {"4096": 75.0}
    del scores["qa_1"]
    assert mean_over_tasks(scores, exclude=PAPER_EXCLUDE) == {"4096": 100.0, "8192": 90.0}
    assert mean_over_tasks({}) == {}
