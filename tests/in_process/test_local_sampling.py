"""LocalFleet sampling on the tiny random Llama: behaviour logprobs equal the train rank's recomputation, groups
depend only on (weights, prompt, seed), greedy held-out requests, EOS and length finish reasons.

One trainer + fleet pair per sampling setting (module fixture, ≈ 4 s to start): unfiltered temperature-1 sampling,
and temperature 0.9 with min-p, top-k and top-p all on. The train rank (``kl_coef`` > 0) holds the initial model as
its reference policy, so ``reference_logprobs`` recomputes, under the rollout's temperature and filters, exactly the
distribution the fleet sampled from.
"""

from __future__ import annotations

import pytest
import torch

from rollout_workers.hf.sampling import RowJob, Sampling, sample_rows
from contract.messages import GroupRequest, SamplingOverride
from grpo.logprobs import logprobs_from_logits
from tests.local_runtime import PROMPTS, local_spec, max_gap, microbatch, requests_for, rows_of, running

SETTINGS = {
    "unfiltered": {"temperature": 1.0},
    "filtered": {"temperature": 0.9, "min_p": 0.01, "top_k": 50, "top_p": 0.8},
}


@pytest.fixture(scope="module", params=sorted(SETTINGS))
def runtime(request, tiny_model_dir, tmp_path_factory):
    spec = local_spec(tiny_model_dir, str(tmp_path_factory.mktemp("sampling")), rollout=SETTINGS[request.param])
    with running(spec, tiny_model_dir) as (trainer, fleet, versions):
        yield spec, trainer, fleet


def test_behaviour_logprobs_equal_the_train_ranks(runtime):
    spec, trainer, fleet = runtime
    groups = fleet.generate(requests_for(fleet.tokenizer, PROMPTS[:3]))
    _, responses, behaviour = rows_of(groups)
    assert len(responses) == 3 * spec.rollout.group_size
    mb, _, _ = microbatch(groups)
    reference = trainer.reference_logprobs(mb)
    gap = max_gap(behaviour, reference)
    assert gap < 2e-5, gap  # measured ≈ 5e-7
    assert all(torch.isfinite(lp).all() and (lp <= 0).all() for lp in behaviour)


def _unfiltered_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / τ) of ``response``'s tokens, teacher-forced through ``model`` (no filters)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    return logprobs_from_logits(logits, torch.tensor(response), temperature)


def test_filters_renormalise_over_the_kept_tokens(runtime):
    """With min-p/top-k/top-p the behaviour logprobs are those of the renormalised kept set: at least the unfiltered
    log-softmax, and above it where the filters removed mass; without filters, equal to it."""
    spec, _, fleet = runtime
    group = fleet.generate(requests_for(fleet.tokenizer, PROMPTS[:1]))[0]
    lift = torch.cat([lp - _unfiltered_logprobs(fleet.model, group.prompt_ids, ids, spec.rollout.temperature)
                      for ids, lp in zip(group.response_ids, group.behaviour_logprobs)])
    assert float(lift.min()) > -2e-5
    if spec.rollout.top_p < 1.0:
        assert float(lift.max()) > 1e-2  # a random model's distribution is flat: the filters drop much mass
    else:
        assert float(lift.abs().max()) < 2e-5


def test_a_group_depends_only_on_weights_prompt_and_seed(runtime):
    _, _, fleet = runtime
    tok = fleet.tokenizer
    alone = fleet.generate(requests_for(tok, PROMPTS[:1]))[0]
    again = fleet.generate(requests_for(tok, PROMPTS[:1]))[0]
    assert again.response_ids == alone.response_ids
    assert all(torch.equal(a, b) for a, b in zip(again.behaviour_logprobs, alone.behaviour_logprobs))
    # the same request (group id 0, seed 1000) among others, placed last, in a batch with longer prompts
    others = [GroupRequest(7, tok(PROMPTS[2])["input_ids"], seed=5), GroupRequest(8, tok(PROMPTS[1])["input_ids"],
                                                                                  seed=6)]
    mixed = fleet.generate(others + requests_for(tok, PROMPTS[:1]))
    assert [g.group_id for g in mixed] == [7, 8, 0]
    assert mixed[2].response_ids == alone.response_ids
    assert max(float((a - b).abs().max()) for a, b in zip(mixed[2].behaviour_logprobs,
                                                           alone.behaviour_logprobs)) < 1e-5
    reseeded = fleet.generate(requests_for(tok, PROMPTS[:1], seed=4242))[0]
    assert reseeded.response_ids != alone.response_ids
    assert len(set(map(tuple, alone.response_ids))) > 1  # the G completions of a group differ from each other


def test_result_fields_follow_the_contract(runtime):
    spec, _, fleet = runtime
    requests = requests_for(fleet.tokenizer, PROMPTS[:2]) + [
        GroupRequest(5, fleet.tokenizer(PROMPTS[3])["input_ids"], group_size=2, seed=3)]
    groups = fleet.generate(requests)
    assert [g.group_id for g in groups] == [0, 1, 5]
    assert [len(g.response_ids) for g in groups] == [4, 4, 2]  # request.group_size, else rollout.group_size
    for req, g in zip(requests, groups):
        assert g.prompt_ids == req.prompt_ids and g.policy_version == 0 and g.complete
        for ids, lp, reason, text in zip(g.response_ids, g.behaviour_logprobs, g.finish_reasons, g.texts):
            assert lp.dtype == torch.float32 and lp.shape == (len(ids),)
            assert text == fleet.tokenizer.decode(ids, skip_special_tokens=True)
            if reason == "length":
                assert len(ids) == spec.rollout.max_response_tokens and ids[-1] not in fleet.eos_ids
            else:
                assert reason == "stop" and ids[-1] in fleet.eos_ids
        assert g.token_versions == [[0] * len(ids) for ids in g.response_ids]


def test_greedy_and_override_requests(runtime):
    """A ``SamplingOverride`` (held-out evaluation): temperature 0 is greedy, with its own length cap and no
    filters; its logprobs are the unfiltered log-softmax at temperature 1."""
    _, _, fleet = runtime
    greedy = fleet.generate(requests_for(fleet.tokenizer, PROMPTS[:2], sampling=SamplingOverride(0.0, 5)),
                            record=False)
    for g in greedy:
        assert len(set(map(tuple, g.response_ids))) == 1  # every completion is the argmax path
        ids = g.response_ids[0]
        assert len(ids) == 5 and g.finish_reasons == ["length"] * len(g.response_ids)
        with torch.no_grad():
            logits = fleet.model(input_ids=torch.tensor([g.prompt_ids + ids])).logits[0, len(g.prompt_ids) - 1:-1]
        assert logits.argmax(-1).tolist() == ids
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        assert float((g.behaviour_logprobs[0] - expected).abs().max()) < 2e-5
    warm = fleet.generate(requests_for(fleet.tokenizer, PROMPTS[:1], sampling=SamplingOverride(0.5, 3)),
                          record=False)[0]
    assert [len(ids) for ids in warm.response_ids] == [3] * 4


def test_eos_ends_a_completion_and_length_caps_it(runtime):
    """The decode loop on the fleet's model: a row that samples an EOS id stops with ``"stop"`` and keeps the EOS as
    its last token; the others run to their cap (``"length"``). The fleet's EOS ids include the tokenizer's."""
    spec, _, fleet = runtime
    assert fleet.tokenizer.eos_token_id in fleet.eos_ids
    tok = fleet.tokenizer
    sampling = Sampling(spec.rollout.temperature, 6, spec.rollout.top_k, spec.rollout.top_p, spec.rollout.min_p)
    jobs = [RowJob(tok(p)["input_ids"], 6, seed, sampling) for seed, p in enumerate(PROMPTS)]
    free = sample_rows(fleet.model, jobs, frozenset([tok.eos_token_id]))
    assert [s.finish_reason for s in free] == ["length"] * len(jobs) and all(len(s.ids) == 6 for s in free)
    eos = free[0].ids[2]  # a token row 0 samples third: declared an EOS id, row 0 must stop there
    stopped = sample_rows(fleet.model, jobs, frozenset([eos]), max_batch_rows=3)
    for before, after in zip(free, stopped):
        cut = before.ids.index(eos) + 1 if eos in before.ids else len(before.ids)
        assert after.ids == before.ids[:cut]
        assert after.finish_reason == ("stop" if eos in before.ids else "length")
        assert max(abs(a - b) for a, b in zip(after.logprobs, before.logprobs)) < 1e-5
    assert stopped[0].ids[-1] == eos and len(stopped[0].ids) <= 3
