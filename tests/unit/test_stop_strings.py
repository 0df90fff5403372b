"""Stop strings (``rollout.stop``, issue 36 item 6) without an engine: the spec field, the semantics the engines share
(``rollout_workers.stops``, checked against vLLM's own ``check_stop_strings``), what the vLLM engine asks vLLM for,
and a completion ended by a stop string counting as terminated."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from cluster.spec import RolloutSpec, SpecError, load_spec_text
from contract.messages import GroupRequest, SamplingOverride
from grpo.eos import response_valid_lengths
from rollout_workers.stops import StopScanner, find_stop

SPEC = "output_dir: runs/test\ntotal_steps: 1\ndata:\n  train_path: train.jsonl\n"


def test_stop_strings_spec_field_defaults_to_none_and_refuses_empty_strings():
    assert load_spec_text(SPEC).rollout.stop == []
    spec = load_spec_text(SPEC + 'rollout:\n  stop: ["</tool_call>", "\\n\\n"]\n')
    assert spec.rollout.stop == ["</tool_call>", "\n\n"]
    with pytest.raises(SpecError, match=r"job.yaml:7: rollout.stop.0: empty string: expected a non-empty value"):
        load_spec_text(SPEC + "rollout:\n  stop:\n    - ''\n", source="job.yaml")
    with pytest.raises(SpecError, match=r"rollout.stop: Input should be a valid list"):
        load_spec_text(SPEC + "rollout:\n  stop: </tool_call>\n")


def test_stop_strings_find_stop_agrees_with_vllms_check_on_random_texts():
    detokenizer = pytest.importorskip("vllm.v1.engine.detokenizer")
    rng = random.Random(0)
    alphabet = "ab</>\n"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        new = rng.randint(0, len(text))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 3))]
        theirs = detokenizer.check_stop_strings(text, new, stops, True)
        ours = find_stop(text, new, stops)
        if theirs is None:
            assert ours is None, (text, new, stops, ours)
        else:  # vLLM says -1 when nothing is to be cut
            assert ours == (theirs[0], len(text) if theirs[1] == -1 else theirs[1]), (text, new, stops, theirs)


def test_stop_strings_scanner_keeps_the_whole_token_that_completes_one_and_cuts_the_text():
    vocab = {1: "Hello", 2: " wor", 3: "ld</to", 4: "ol>\nmore", 5: "x"}
    scanner = StopScanner(["</tool>"], lambda ids: "".join(vocab[i] for i in ids))
    assert [scanner.add(t) for t in (1, 2, 3)] == [False, False, False]
    assert scanner.add(4)  # the stop string ends inside token 4's text
    assert scanner.ids == [1, 2, 3, 4] and scanner.stop_reason == "</tool>"
    assert scanner.text == "Hello world</tool>"  # the text is cut at the stop string's end, the tokens are not
    earliest = StopScanner(["ol>", "world"], lambda ids: "".join(vocab[i] for i in ids))
    assert [earliest.add(t) for t in (1, 2, 3)] == [False, False, True] and earliest.stop_reason == "world"
    assert not StopScanner([], lambda ids: "").add(1)


def test_stop_strings_straddling_an_interruption_are_matched_in_the_continued_completion():
    vocab = {1: "Hello", 2: " wor", 3: "ld</to", 4: "ol>\nmore", 5: "x"}
    decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    continued = StopScanner(["</tool>"], decode, prefix=[1, 2, 3])  # interrupted after "...</to"
    assert continued.add(4) and continued.ids == [4] and continued.text == "ol>"
    assert not StopScanner(["</tool>"], decode, prefix=[1, 2, 3, 4]).add(5)  # a stop string seen before is not new


def test_stop_strings_wait_for_a_whole_character():
    # a multi-byte character split over two tokens decodes as U+FFFD until its last byte arrives
    scanner = StopScanner(["\ufffd", "</s>"], lambda ids: "a\ufffd" if ids == [1] else "aé</s>")
    assert not scanner.add(1) and scanner.add(2) and scanner.stop_reason == "</s>"


def test_stop_strings_go_to_vllm_with_the_stop_text_kept_in_the_output():
    from rollout_workers.vllm.engine import VLLMEngine

    engine = SimpleNamespace(rollout=RolloutSpec(max_response_tokens=64, stop=["</tool_call>"]))
    train = VLLMEngine._sampling(engine, GroupRequest(0, [1], seed=5))
    assert train["stop"] == ["</tool_call>"] and train["include_stop_str_in_output"] is True
    held = VLLMEngine._sampling(engine, GroupRequest(0, [1], sampling=SamplingOverride(0.0, 8)))
    assert held["stop"] == ["</tool_call>"] and held["max_tokens"] == 8
    plain = VLLMEngine._sampling(SimpleNamespace(rollout=RolloutSpec()), GroupRequest(0, [1]))
    assert "stop" not in plain and "include_stop_str_in_output" not in plain  # vLLM's defaults without stop strings


def test_stop_strings_end_a_completion_as_terminated_without_an_eos():
    eos = {9}
    lengths, terminated = response_valid_lengths([[1, 2, 3], [1, 9, 2], [4, 5]], eos, None, [True, True, False])
    assert lengths == [3, 2, 2] and terminated == [True, True, False]  # stop string, EOS, length cap
    assert response_valid_lengths([[1, 2, 3]], eos)[1] == [False]  # no finish reasons given: EOS only
