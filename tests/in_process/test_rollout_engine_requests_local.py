"""Request-level generation on the in-process runtime (issue 36, item 2): ``LocalFleet.submit`` over the ``hf``
engine's batching thread, on the tiny random Llama.

- A group's G completions served as G requests (seeds s + i) are exactly what ``generate`` samples for the group:
  single-turn numerics and seeds are the same through either path.
- A weight sync while requests run pauses them and continues them on the new weights: every future resolves, each
  token carries the version that sampled it, and the tokens of each version have that version's logprobs.
- An episode's next turn does not wait for another episode: a request submitted while a long one runs is served in
  the next decode batch, long before the other episode ends.
- The step figures: ``rollout/request_queue_s`` and the idle share from the engine's own busy counter.
"""

from __future__ import annotations

import threading
import time

import torch

from contract.requests import TokenRequest
from tests.local_runtime import PROMPTS, local_spec, requests_for, running, train_on


def _policy_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """[R] float32: the model's log-probability (temperature 1, no filters) of each response token."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_rollout_engine_served_requests_equal_the_generated_group(tiny_model_dir, tmp_path):
    spec = local_spec(tiny_model_dir, str(tmp_path))
    with running(spec, tiny_model_dir) as (_, fleet, _):
        (group,) = fleet.generate(requests_for(fleet.tokenizer, PROMPTS[:1]))
        r = spec.rollout
        futures = [fleet.submit(TokenRequest(f"g0-{i}", tuple(group.prompt_ids), r.max_response_tokens,
                                             temperature=r.temperature, seed=1000 + i, group_id=0, sample=i))
                   for i in range(r.group_size)]
        results = [f.result(60) for f in futures]
    assert [x.token_ids for x in results] == group.response_ids
    assert all(torch.equal(torch.tensor(x.logprobs), lp) for x, lp in zip(results, group.behaviour_logprobs))
    assert [x.finish_reason for x in results] == group.finish_reasons
    assert all(x.token_versions == [0] * len(x.token_ids) and x.engine == "engine-0" for x in results)


def test_rollout_engine_requests_continue_across_a_weight_sync_on_the_new_version(tiny_model_dir, tmp_path):
    spec = local_spec(tiny_model_dir, str(tmp_path), rollout={"max_response_tokens": 8})
    with running(spec, tiny_model_dir) as (trainer, fleet, versions):
        train_on(trainer, versions, fleet.generate(requests_for(fleet.tokenizer, PROMPTS[:2])))  # version 1
        prompt = tuple(fleet.tokenizer(PROMPTS[2])["input_ids"])
        futures = [fleet.submit(TokenRequest(f"long-{i}", prompt, 400, seed=7 + i)) for i in range(4)]
        deadline = time.monotonic() + 60
        while fleet.engine.busy_seconds() < 0.3 and time.monotonic() < deadline:
            time.sleep(0.01)  # the batch runs on version 0
        report = fleet.sync_policy()  # pauses it, loads version 1, continues it
        results = [f.result(120) for f in futures]
        model = fleet.model
        eos = fleet.tokenizer.eos_token_id
        assert report.policy_version == 1 and report.verified
        spanning = 0
        for x in results:
            n = len(x.token_ids)  # where the sync lands is timing: version 1 may sample an EOS before token 400
            assert (n, x.finish_reason) == (400, "length") or (x.finish_reason, x.token_ids[-1]) == ("stop", eos)
            cut = x.token_versions.count(0)  # every token of version 0 first, then version 1's
            assert x.token_versions == [0] * cut + [1] * (n - cut)
            new = _policy_logprobs(model, list(prompt), x.token_ids)
            lps = torch.tensor(x.logprobs)
            if cut < n:
                assert float((lps[cut:] - new[cut:]).abs().max()) < 1e-4  # sampled by the synced weights
            if cut >= 8:
                assert float((lps[:cut] - new[:cut]).abs().max()) > 1e-3  # ... and these by version 0
            spanning += 0 < cut < n
        assert spanning >= 1, [x.token_versions.count(0) for x in results]  # the sync landed mid-request


def test_rollout_engine_a_turn_waits_for_the_decode_batch_not_for_other_episodes(tiny_model_dir, tmp_path):
    spec = local_spec(tiny_model_dir, str(tmp_path))
    with running(spec, tiny_model_dir) as (_, fleet, _):
        fleet.begin_step()
        prompt = tuple(fleet.tokenizer(PROMPTS[0])["input_ids"])
        finished: dict[str, float] = {}

        def episode(name: str, turns: int, tokens: int, tool_s: float) -> None:
            ids = list(prompt)
            for turn in range(turns):
                result = fleet.submit(TokenRequest(f"{name}-{turn}", tuple(ids), tokens, seed=turn)).result(60)
                ids += result.token_ids + [13]  # the observation: one token
                time.sleep(tool_s)
            finished[name] = time.perf_counter()

        long = threading.Thread(target=episode, args=("long", 3, 120, 0.5))
        long.start()
        time.sleep(0.2)
        episode("short", 1, 4, 0.0)
        long.join(120)
    assert finished["short"] < finished["long"] - 0.5  # it did not wait for the long episode's other turns
    figures = fleet.figures
    assert len(figures.request_queue_s) == 4 and figures.request_queue_mean_s >= 0
    assert 0.0 < figures.request_idle_fraction < 1.0  # the engine idled while the long episode's tool ran
