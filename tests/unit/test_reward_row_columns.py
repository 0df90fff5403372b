"""A whole-row reward's load-time check when the row lacks a column its function needs: the message lists the row's
columns besides the prompt and suggests a near spelling (``grpo.rewards.checks.RowCheck``)."""

import pytest

from grpo.rewards.calling import signature_of
from grpo.rewards.checks import RowCheck


def mentions(completions, word, **kwargs):
    return [float(word in c) for c in completions]


CHECK = RowCheck("mentions", "algorithm.rewards", signature_of(mentions, "mentions"), None, "myreward.py:1")


@pytest.mark.parametrize("columns, expected", [
    ({}, "its columns besides the prompt: none);"),
    ({"wrod": "x"}, "its columns besides the prompt: ['wrod']; did you mean column 'wrod'?);"),
    ({"topic": "x"}, "its columns besides the prompt: ['topic']);"),
])
def test_a_missing_column_lists_the_others_and_suggests_a_spelling(columns, expected):
    with pytest.raises(ValueError) as caught:
        CHECK("Say hello", columns, None)
    assert "takes 'word' without a default" in str(caught.value) and expected in str(caught.value)


def test_a_row_with_the_column_passes():
    CHECK("Say hello", {"word": "hello"}, None)
