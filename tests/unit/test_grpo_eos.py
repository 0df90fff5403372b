"""Unit tests for grpo.eos: termination only from the response's own EOS ids, tokens after EOS masked."""

import pytest

from grpo.eos import eos_token_ids, response_valid_lengths


def test_eos_ids_union_of_generation_config_and_tokenizer():
    assert eos_token_ids([128001, 128008, 128009], 128009) == {128001, 128008, 128009}
    assert eos_token_ids(2, None) == {2}
    assert eos_token_ids(None, 7) == {7}
    with pytest.raises(ValueError, match="no EOS token id"):
        eos_token_ids(None, None)
    with pytest.raises(ValueError, match="non-negative ints"):
        eos_token_ids(["2"], None)


def test_terminated_only_when_the_response_contains_an_eos_id():
    eos = eos_token_ids([2, 9], None)
    responses = [[5, 6, 2], [5, 9, 7, 8], [5, 6, 7, 8], [2], []]
    lengths, terminated = response_valid_lengths(responses, eos)
    assert terminated == [True, True, False, True, False]
    # Tokens after the first EOS are masked; the EOS itself counts.
    assert lengths == [3, 2, 4, 1, 0]


def test_prompt_eos_does_not_count():
    # The prompt (e.g. a chat template ending in an EOS-like id) is never passed: only the response is inspected.
    prompt, response = [1, 2, 3], [4, 5, 6]
    lengths, terminated = response_valid_lengths([response], {2})
    assert terminated == [False] and lengths == [3]
    assert 2 in prompt
