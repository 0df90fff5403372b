"""Agents on the in-process runtime's agent pool (local worker processes, ``cluster.in_process.agent_pool``), calling a
stand-in chat-completions endpoint (``tests/agent_endpoint.py``: FastAPI + uvicorn) with the real ``openai`` client:
many episodes run at once on one worker, and every bad agent — one that raises, hangs, blocks its worker's event loop,
kills its worker, calls the endpoint after its episode ended, runs out of its token budget, rewrites its history, or
returns a non-number — ends as a counted infrastructure or policy failure of that episode (or, for a rewrite, two
training sequences) with a one-line reason, while the pool goes on serving."""

from __future__ import annotations

import faulthandler
import time
from concurrent.futures import TimeoutError

import pytest

from cluster.agents.plan import AgentPlan
from cluster.agents.pool import AgentWorkerPool
from cluster.in_process.agent_pool import ProcessAgentWorker
from cluster.loop.agent_sequences import agent_sequences
from contract.agents import EpisodeTicket
from tests.agent_endpoint import StandInEndpoint, scripted_sampler

AGENT = '''\
import asyncio
import os
import time


async def ask(client, messages, max_tokens=8):
    response = await client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)
    return response.choices[0].message.content


async def run(client, row, mode="ok"):
    mode = row.get("mode", mode)
    messages = [{"role": "user", "content": row["prompt"]}]
    if mode == "ok":
        text = await ask(client, messages)
        return {"correct": float("4" in text), "format": 0.5}
    if mode == "slow":
        await asyncio.sleep(1.0)
        return 1.0
    if mode == "raises":
        await ask(client, messages)
        raise ValueError("the tool broke")
    if mode == "hangs":
        await asyncio.sleep(3600)
    if mode == "blocks":
        time.sleep(3600)
    if mode == "dies":
        os._exit(3)
    if mode == "string":
        await ask(client, messages)
        return "0.9"
    if mode == "late":
        await ask(client, messages)
        asyncio.get_running_loop().create_task(late(client, messages))
        return 1.0
    if mode == "budget":
        while True:
            text = await ask(client, messages, max_tokens=10_000)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on, in detail."}]
    if mode == "rewrites":
        text = await ask(client, messages)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Shorter."}]
        await ask(client, messages)
        summary = [{"role": "user", "content": row["prompt"] + " (summarised: you answered before)"}]
        await ask(client, summary)
        return 1.0


async def late(client, messages):
    import openai

    await asyncio.sleep(0.5)  # the episode has ended (and its client was closed): a client of its own
    await ask(openai.AsyncOpenAI(base_url=str(client.base_url), api_key="x", max_retries=0), messages)
'''


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def endpoint(tokenizer):
    ep = StandInEndpoint(tokenizer, scripted_sampler(tokenizer, ["It is 4."]), max_call_tokens=16)
    ep.start()
    yield ep
    ep.shutdown()


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("agents")
    (folder / "agent.py").write_text(AGENT)
    return folder


def make_pool(agent_dir, mode: str, episodes: int = 4, timeout_s: float = 20.0) -> AgentWorkerPool:
    plan = AgentPlan("function", "agent.py:run", (str(agent_dir), None), {"mode": mode}, timeout_s=timeout_s)
    return AgentWorkerPool(lambda index: ProcessAgentWorker(plan, 120), 1, episodes, timeout_s, "local processes",
                           grace_s=2.0)


def run_episodes(pool, endpoint, n: int, mode: str | None = None, budget: int = 200):
    """n episodes at once (their rows' ``mode`` column choosing what the agent does); (outcomes, records) in
    order."""
    keys = [f"{time.monotonic_ns()}-{i}" for i in range(n)]
    row = {"prompt": "What is 2 + 2?", "reference": "4", **({"mode": mode} if mode else {})}
    futures = [pool.submit(EpisodeTicket(k, endpoint.open_episode(k, seed=i, max_episode_tokens=budget, sample=i),
                                         row)) for i, k in enumerate(keys)]
    try:
        outcomes = [f.result(timeout=120) for f in futures]
    except TimeoutError:  # seen once in CI and not reproduced since: every thread's stack, for the next time
        faulthandler.dump_traceback(all_threads=True)
        raise AssertionError(f"episodes not ended within 120 s; pool metrics {pool.metrics()}") from None
    return outcomes, [endpoint.close_episode(k) for k in keys]


@pytest.fixture(scope="module")
def pool(agent_dir):
    """One worker, 8 episodes at once, 3 s per episode, shared by the tests whose agents leave the worker alive."""
    pool = make_pool(agent_dir, "ok", episodes=8, timeout_s=3.0)
    pool.start()
    yield pool
    pool.shutdown()


@pytest.fixture
def pool_of(agent_dir):
    pools = []

    def make(mode, **kw):
        pool = make_pool(agent_dir, mode, **kw)
        pool.start()
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.shutdown()


def test_agent_episodes_run_at_once_on_one_worker_and_train_from_records(pool, endpoint, tokenizer):
    t0 = time.monotonic()
    outcomes, _ = run_episodes(pool, endpoint, 8, "slow")
    assert [o.reward for o in outcomes] == [1.0] * 8 and time.monotonic() - t0 < 6.0  # not 8 x 1 s one by one
    outcomes, records = run_episodes(pool, endpoint, 2)
    assert outcomes[0].components == {"correct": 1.0, "format": 0.5} and outcomes[0].reward == 1.5
    (seq,) = agent_sequences(records[0])
    assert tokenizer.decode(seq.response_ids, skip_special_tokens=True) == "It is 4."


@pytest.mark.parametrize("mode, words", [
    ("raises", "the agent raised ValueError: the tool broke ("),
    ("string", "the agent returned '0.9' of type str"),
    ("hangs", "the episode ran past rollout.agent_pool.timeout_s = 3 s and was cancelled"),
])
def test_agent_that_raises_hangs_or_returns_a_non_number_is_an_infrastructure_failure(pool, endpoint, mode,
                                                                                       words):
    outcomes, _ = run_episodes(pool, endpoint, 2, mode)
    for outcome in outcomes:
        assert (outcome.reward, outcome.failure) == (None, "infra") and words in outcome.detail
        assert "\n" not in outcome.detail
    if mode == "raises":
        assert "agent.py:22)" in outcomes[0].detail  # the agent's own line
    assert pool.metrics()["agent_pool/worker_restarts"] == 0  # the worker keeps serving


@pytest.mark.parametrize("mode, words", [
    ("blocks", "did not finish an episode within rollout.agent_pool.timeout_s + 2 s"),
    ("dies", "died (AgentWorkerLost: agent worker process"),
])
def test_agent_that_blocks_or_kills_its_worker_loses_its_episodes_and_the_worker_is_replaced(pool_of, endpoint,
                                                                                               agent_dir, mode,
                                                                                               words, caplog):
    pool = pool_of(mode, timeout_s=2.0)
    outcomes, _ = run_episodes(pool, endpoint, 2)
    assert all(o.failure == "infra" and words in o.detail for o in outcomes), outcomes
    deadline = time.monotonic() + 60
    while pool.metrics()["agent_pool/worker_restarts"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pool.metrics()["agent_pool/lost_episodes"] == 2 and pool.metrics()["agent_pool/worker_restarts"] >= 1
    assert any(words in r.getMessage() and "the worker is replaced" in r.getMessage() for r in caplog.records)


def test_agent_calling_after_its_episode_ended_is_refused_and_changes_nothing(pool, endpoint):
    before = len(endpoint.late_calls)
    outcomes, records = run_episodes(pool, endpoint, 1, "late")
    assert outcomes[0].reward == 1.0 and len(records[0].calls) == 1
    deadline = time.monotonic() + 10
    while len(endpoint.late_calls) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "which is not open (it ended)" in endpoint.late_calls[-1]


def test_agent_that_runs_out_of_its_token_budget_is_a_policy_failure(pool, endpoint):
    outcomes, records = run_episodes(pool, endpoint, 1, "budget", budget=80)
    outcome, record = outcomes[0], records[0]
    assert (outcome.reward, outcome.failure, outcome.ended) == (0.0, "policy", "token_budget")
    assert len(record.calls) >= 2 and "no room left in the episode's budget of 80" in record.refused[-1]
    assert all(len(c.prompt_ids) + len(c.completion_ids) <= 80 for c in record.calls)  # capped at what was left
    (seq,) = agent_sequences(record)  # it extended its history: one sequence, still trained
    assert len(seq.prompt_ids) + len(seq.response_ids) <= 80


def test_agent_that_rewrites_its_history_trains_two_sequences(pool, endpoint):
    outcomes, records = run_episodes(pool, endpoint, 1, "rewrites")
    assert outcomes[0].reward == 1.0
    assert [c.extends for c in records[0].calls] == [False, True, False]
    first, second = agent_sequences(records[0])
    assert first.calls == 2 and second.calls == 1
