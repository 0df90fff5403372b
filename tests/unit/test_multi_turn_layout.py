"""The token layout of multi-turn episodes outside the engines: observation tokens by rendering difference (and the
drift re-rendering would cause under a template that strips earlier ``<think>`` blocks), the per-token loss mask in
packing (single completions unchanged), an episode's EOS and loss tokens, its scoring (turn rewards, environment
failures as missing rewards) and the ``episode/*`` metrics."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.loop.episode_metrics import episode_metrics
from cluster.loop.observation_tokens import ObservationTokenError, ObservationTokens
from cluster.loop.scoring import Scoring
from cluster.spec import load_spec_text
from contract.messages import EpisodeSummary, GroupResult
from grpo.eos import response_valid_lengths
from train_workers.packing import pack_microbatch

#: Like DeepSeek-R1's and Qwen3's: an assistant message before the last one loses its <think> block when rendered.
THINK_STRIPPING = (
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and not loop.last -%}{%- set content = content.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_ids(tokenizer, messages, template=None, generation_prompt=True) -> list[int]:
    extra = {} if template is None else {"chat_template": template}
    return encode(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False,
                                                           add_generation_prompt=generation_prompt, **extra))


def test_multi_turn_observation_tokens_continue_the_sampled_tokens_as_the_template_would(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    observations = ObservationTokens(tokenizer)
    assert observations.close_ids == [end, *encode(tokenizer, "\n")]
    user = [{"role": "user", "content": "What is 12 * 34?"}]
    prompt = render_ids(tokenizer, user)
    turn = encode(tokenizer, '<tool_call>{"name": "calculator"}</tool_call>') + [end]  # ended with <|im_end|>
    obs = observations.ids("tool", "calculator: 408", turn)
    conversation = [*user, {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
                    {"role": "tool", "content": "calculator: 408"}]
    assert prompt + turn + obs == render_ids(tokenizer, conversation)  # what the template renders, token for token
    cut = encode(tokenizer, "<tool_call>{")  # a turn cut at its token cap: the delimiter closes it
    assert observations.ids("tool", "x", cut)[0] == end and observations.ids("tool", "x", turn)[0] != end


def test_multi_turn_layout_keeps_what_a_think_stripping_template_would_drop(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    observations = ObservationTokens(tokenizer, THINK_STRIPPING)
    user = [{"role": "user", "content": "Add 2 and 3."}]
    prompt = render_ids(tokenizer, user, THINK_STRIPPING)
    thought = "<think>2 plus 3, check with the tool.</think>Let me check."
    turn1 = encode(tokenizer, thought) + [end]
    obs = observations.ids("tool", "5", turn1)
    turn2 = encode(tokenizer, "<think>It said 5.</think>#### 5") + [end]
    episode = prompt + turn1 + obs + turn2  # what the policy sampled and read, in order
    history = [*user, {"role": "assistant", "content": thought}, {"role": "tool", "content": "5"}]
    rerendered = render_ids(tokenizer, history, THINK_STRIPPING)  # turn 2's context built from text again
    think = encode(tokenizer, "<think>2 plus 3, check with the tool.</think>")
    assert episode[len(prompt):len(prompt) + len(think)] == think  # the sampled <think> block is kept
    assert rerendered != episode[:len(rerendered)] and len(rerendered) < len(prompt + turn1 + obs)  # drift
    assert rerendered == prompt + encode(tokenizer, "Let me check.") + [end] + obs  # it dropped the <think> block
    plain = encode(tokenizer, "Let me check.") + [end]  # without a <think> block the two agree exactly
    no_think = [*user, {"role": "assistant", "content": "Let me check."}, {"role": "tool", "content": "5"}]
    assert prompt + plain + observations.ids("tool", "5", plain) == render_ids(tokenizer, no_think, THINK_STRIPPING)


def test_multi_turn_observation_tokens_refuse_a_template_that_rewrites_earlier_turns(tokenizer):
    counting = ("{{ messages | length }}{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
                "+ '<|im_end|>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
                "{%- endif -%}")
    with pytest.raises(ObservationTokenError, match="changes the tokens of the messages before it"):
        ObservationTokens(tokenizer, counting).ids("tool", "5", [1])
    with pytest.raises(ObservationTokenError, match="does not render an assistant message's content"):
        ObservationTokens(tokenizer, "{% for m in messages %}{{ m['role'] }}{% endfor %}")


def test_multi_turn_packing_masks_observations_and_leaves_single_completions_unchanged():
    prompts, responses = [[1, 2], [3]], [[4, 5, 6, 7, 8], [9, 10, 11]]
    lps = [torch.tensor([-0.1, -0.2, 0.0, 0.0, -0.5]), torch.tensor([-0.3, -0.4, -0.6])]
    plain = pack_microbatch(prompts, responses, [1.0, -1.0], lps, [0, 1], valid_lengths=[5, 2])
    for masks in (None, [None, None], [[True] * 5, [True] * 3]):
        same = pack_microbatch(prompts, responses, [1.0, -1.0], lps, [0, 1], valid_lengths=[5, 2], loss_masks=masks)
        assert all(torch.equal(getattr(plain, f), getattr(same, f)) for f in (
            "input_ids", "position_ids", "logit_positions", "targets", "response_mask", "behaviour_logprobs"))
    episode = pack_microbatch(prompts, responses, [1.0, -1.0], lps, [0, 1], valid_lengths=[5, 2],
                              loss_masks=[[True, True, False, False, True], None])
    assert episode.response_mask.tolist() == [[True, True, False, False, True], [True, True, False, False, False]]
    assert torch.equal(episode.input_ids, plain.input_ids)  # observations are packed and run forward
    with pytest.raises(ValueError, match="loss mask of 2"):
        pack_microbatch(prompts, responses, [1.0, -1.0], lps, [0, 1], loss_masks=[[True, False], None])


def test_multi_turn_only_the_last_turn_ends_an_episode():
    eos = {2}
    ids = [[5, 2, 9, 9, 6, 2, 7], [5, 2, 9, 6, 6], [5, 6, 2, 7]]
    masks = [[True, True, False, False, True, True, True], [True, True, False, True, True], None]
    assert response_valid_lengths(ids[:2], eos, masks[:2]) == ([6, 5], [True, False])
    assert response_valid_lengths(ids[:2], eos) == ([2, 2], [True, True])  # without the masks turn 1 would end it
    with pytest.raises(ValueError, match="row 0: 2 sampled-mask entries for 7 response tokens"):
        response_valid_lengths(ids[:1], eos, [[True, True]])


SPEC = """\
output_dir: runs/test
total_steps: 1
data:
  train_path: train.jsonl
rollout:
  max_response_tokens: 4
  multi_turn: {environment: scripted, max_turns: 3, max_episode_tokens: 32}
algorithm:
  rewards: {accuracy: 1.0, format: 0.0}
"""


def episode_group(gid: int, rows, texts) -> GroupResult:
    """rows: (ids, sampled mask, summary) per episode."""
    ids = [r[0] for r in rows]
    lps = [torch.where(torch.tensor(r[1]), torch.full((len(r[0]),), -0.5), torch.zeros(len(r[0]))) for r in rows]
    return GroupResult(gid, [2, 11], ids, lps, ["stop"] * len(rows), texts, 0, loss_masks=[r[1] for r in rows],
                       episodes=[r[2] for r in rows])


def test_multi_turn_scoring_adds_turn_rewards_and_excludes_environment_failures():
    spec = load_spec_text(SPEC)
    scoring = Scoring(spec.algorithm, spec.rollout.max_response_tokens, frozenset({2}))
    two_turns = [True, True, False, False, True, True]
    groups = [episode_group(0, [([5, 2, 9, 9, 6, 2], two_turns, EpisodeSummary(2, turn_reward=0.5)),
                                ([5, 2, 9, 9, 6, 2], two_turns, EpisodeSummary(2)),
                                ([5, 2, 9, 9, 6, 2], two_turns, EpisodeSummary(1, ended="infra_failed"))],
                            ["#### 3", "#### 3", "#### 3"])]
    batch = scoring.score(groups, ["#### 3"])
    assert torch.equal(batch.per_function["environment"][:2], torch.tensor([0.5, 0.0]))
    assert batch.rewards[:2].tolist() == [1.5, 1.0] and math.isnan(batch.rewards[2])
    assert batch.valid_lengths == [6, 6, 0] and batch.terminated == [True, True, True]
    assert batch.loss_token_counts() == [4, 4, 0] and batch.sampled_lengths() == [4, 4, 4]
    assert batch.advantages[2] == 0 and batch.advantages[0] > 0 > batch.advantages[1]
    assert batch.loss_mask(0).tolist() == two_turns and batch.episodes[2].infra_failed


def test_multi_turn_episode_metrics():
    episodes = [EpisodeSummary(3, tool_calls=2, tool_errors=1, observation_tokens=20, ended="max_turns"),
                EpisodeSummary(1, ended="done", environment_s=0.5),
                EpisodeSummary(2, tool_calls=2, observation_tokens=10, ended="token_budget", restarts=1),
                EpisodeSummary(1, ended="infra_failed")]
    m = episode_metrics(episodes)
    assert m == {"episode/turns_mean": 1.75, "episode/tool_calls_mean": 1.0, "episode/tool_success_rate": 0.75,
                 "episode/observation_tokens_mean": 7.5, "episode/done_fraction": 0.25,
                 "episode/max_turns_fraction": 0.25, "episode/token_budget_fraction": 0.25,
                 "episode/infra_failed": 1.0, "episode/restarts": 1.0, "episode/environment_s": 0.5}
    assert math.isnan(episode_metrics([EpisodeSummary(1)])["episode/tool_success_rate"])
    assert episode_metrics([]) == {}
