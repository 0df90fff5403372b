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


def test_prompt_eos_does_not_count_in_the_driver():
    """The driver's score stage passes only the response ids to ``response_valid_lengths``: a prompt made of EOS ids
    (a chat template ending in an EOS-like id) terminates nothing."""
    import torch

    from cluster.loop.scoring import Scoring
    from cluster.spec import load_spec_text
    from contract.messages import GroupResult

    spec = load_spec_text("output_dir: o\ntotal_steps: 1\ndata: {train_path: t.jsonl}\n"
                          "algorithm: {mask_truncated: false}\n")
    scoring = Scoring(spec.algorithm, spec.rollout.max_response_tokens, eos_token_ids(2, None))
    responses = [[4, 5, 6], [4, 2, 6], [7]]
    group = GroupResult(0, [2, 2, 2], responses, [torch.zeros(len(r)) for r in responses], ["length", "stop", "length"],
                        ["#### 1", "#### 2", "#### 3"], 0)
    batch = scoring.score([group], ["#### 1"])
    assert batch.terminated == [False, True, False]
    assert batch.valid_lengths == [3, 2, 1]
    assert batch.prompt_ids == [[2, 2, 2]] * 3 and batch.response_ids == responses
