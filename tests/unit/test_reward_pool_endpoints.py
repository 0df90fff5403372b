"""Issue #27 item 3, remote reward endpoints (``cluster.rewards.endpoint``, spec ``reward_endpoints``) against a
local ``http.server`` in a thread (``tests/reward_faults.RewardServer``): good replies in batches, a slow service
(timeout), 500s then success (retried with backoff), connection refused, the wrong count, malformed replies; the
endpoint named in ``algorithm.rewards``; an unreachable one refused before anything starts, naming the field. Then
the client itself (httpx): one kept-alive connection across batches and retries, a dropped connection retried with
backoff, one client shared by a reward pool's threads."""

from __future__ import annotations

import socket
import time

import pytest

from cluster.loop.setup import SetupError, check_reward_endpoints
from cluster.spec import SpecError, load_spec_text
from grpo.rewards import REWARD_FUNCTIONS, UNSCORED, combine_rewards
from cluster.rewards.endpoint import EndpointReward
from tests.reward_faults import RewardServer

MINIMAL = "output_dir: runs/test\ntotal_steps: 3\ndata:\n  train_path: train.jsonl\n"


@pytest.fixture
def server():
    s = RewardServer()
    yield s
    s.close()


def closed_port_url() -> str:
    """An address where nothing listens (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/score"


def rows(n: int):
    completions = [str(i) for i in range(n)]
    answers = [str(i) if i % 3 else "x" for i in range(n)]
    return completions, answers


def test_reward_pool_endpoint_scores_in_batches_with_every_column(server):
    rm = EndpointReward("rm", server.url, batch_size=4, headers={"Authorization": "Bearer t0k"})
    completions, answers = rows(10)
    scores = rm(prompts=[f"q{i}" for i in range(10)], completions=completions, answer=answers, level=list(range(10)))
    assert scores == [float(c == a) for c, a in zip(completions, answers)]
    bodies = [b for b, _ in server.requests]
    assert [len(b["completions"]) for b in bodies] == [4, 4, 2]
    assert bodies[2] == {"prompts": ["q8", "q9"], "completions": ["8", "9"], "answer": ["8", "x"], "level": [8, 9]}
    assert all(h["Authorization"] == "Bearer t0k" and h["Content-Type"] == "application/json"
               for _, h in server.requests)


def test_reward_pool_endpoint_500s_are_retried_with_backoff_then_succeed(server):
    server.fail_next = 2
    rm = EndpointReward("rm", server.url, max_retries=2, backoff_s=0.2)
    t0 = time.monotonic()
    assert rm(prompts=["q", "q"], completions=["1", "2"], answer=["1", "1"]) == [1.0, 0.0]
    assert len(server.requests) == 3 and time.monotonic() - t0 >= 0.2 + 0.4  # waited 0.2 s, then 0.4 s


@pytest.mark.parametrize("status, attempts", [(503, 3), (429, 3), (400, 1), (401, 1)])
def test_reward_pool_endpoint_failing_for_good_gives_no_scores(server, status, attempts):
    server.fail_next, server.status = 100, status
    rm = EndpointReward("rm", server.url, max_retries=2, backoff_s=0.01)
    assert rm(prompts=["q"] * 3, completions=["1", "2", "3"], answer=["1"] * 3) == [UNSCORED] * 3
    assert len(server.requests) == attempts  # a 4xx other than 408/429 is not retried


def test_reward_pool_endpoint_timeout_gives_no_scores_after_the_retries(server):
    server.delay_s = 3.0
    rm = EndpointReward("rm", server.url, timeout_s=0.5, max_retries=1, backoff_s=0.1, batch_size=2)
    t0 = time.monotonic()
    assert rm(prompts=["q"] * 3, completions=["SLOW", "1", "1"], answer=["1"] * 3) == [UNSCORED, UNSCORED, 1.0]
    assert time.monotonic() - t0 < 2.9  # two attempts of 0.5 s for the slow batch, never the service's 3 s
    assert len(server.requests) == 3


def test_reward_pool_endpoint_connection_refused_gives_no_scores():
    rm = EndpointReward("rm", closed_port_url(), max_retries=1, backoff_s=0.01)
    assert rm(prompts=["q"], completions=["1"]) == [UNSCORED]


@pytest.mark.parametrize("reply", [b'{"rewards": [1.0]}', b"not json", b'{"scores": [1, 0]}', b'[1, 0]',
                                   b'{"rewards": [1, "high"]}'])
def test_reward_pool_endpoint_malformed_replies_give_no_scores_without_retry(server, reply):
    server.reply = reply
    rm = EndpointReward("rm", server.url, max_retries=3, backoff_s=0.01)
    assert rm(prompts=["q", "q"], completions=["1", "2"]) == [UNSCORED, UNSCORED]
    assert len(server.requests) == 1


def test_reward_pool_endpoint_null_and_integer_rewards_pass_through(server):
    server.reply = b'{"rewards": [null, 1, 0.25]}'
    assert EndpointReward("rm", server.url)(prompts=["q"] * 3, completions=["a", "b", "c"]) == [None, 1.0, 0.25]


def test_reward_pool_endpoint_named_in_algorithm_rewards_is_a_weighted_whole_row_reward(server, monkeypatch):
    monkeypatch.setenv("RM_TOKEN", "s3cret")
    spec = load_spec_text(MINIMAL + f"reward_endpoints:\n  judge: {{url: '{server.url}', batch_size: 2, headers: "
                                    "{Authorization: 'Bearer ${RM_TOKEN}'}}\nalgorithm:\n  rewards: {judge: 1.0, "
                                    "format: 0.1}\n")
    try:
        assert spec.reward_endpoints["judge"].headers == {"Authorization": "Bearer ${RM_TOKEN}"}  # as written
        out = combine_rewards(["1", "2", "3"], ["1", "1", "3"], {"judge": 1.0}, prompts=["q"] * 3,
                              columns={"answer": ["1", "1", "3"]})
        assert out.total.tolist() == [1.0, 0.0, 1.0]
        assert server.requests[0][1]["Authorization"] == "Bearer s3cret"
        assert load_spec_text(MINIMAL + f"reward_endpoints:\n  judge: {{url: '{server.url}'}}\n").reward_endpoints
    finally:
        REWARD_FUNCTIONS.pop("judge")


@pytest.mark.parametrize("endpoints, message", [
    ("{accuracy: {url: 'http://h/x'}}", "job.yaml:5: reward_endpoints: accuracy: 'accuracy' is already a reward "
                                        "function"),
    ("{'a:b': {url: 'http://h/x'}}", "reward endpoint name 'a:b': expected a plain name (no ':')"),
    ("{rm: {url: 'ftp://h/x'}}", "reward_endpoints.rm.url: String should match pattern"),
    ("{rm: {url: 'http://h/x', headers: {X: '${GRPO_NOT_SET_VAR}'}}}",
     "rm.headers: environment variable GRPO_NOT_SET_VAR is not set"),
    ("{rm: {url: 'http://h/x', max_retries: 50}}", "reward_endpoints.rm.max_retries: Input should be less than or "
                                                   "equal to 20"),
])
def test_reward_pool_endpoint_bad_settings_name_the_field(endpoints, message):
    with pytest.raises(SpecError) as info:
        load_spec_text(MINIMAL + f"reward_endpoints: {endpoints}\n", source="job.yaml")
    assert message in str(info.value), str(info.value)
    REWARD_FUNCTIONS.pop("rm", None)


def test_reward_pool_endpoint_unreachable_at_start_is_refused_naming_the_field(server):
    up = load_spec_text(MINIMAL + f"reward_endpoints:\n  rm: {{url: '{server.url}'}}\n  rm2: {{url: '{server.url}', "
                                  f"health_url: '{server.health_url}'}}\n")
    down = load_spec_text(MINIMAL + f"reward_endpoints:\n  rm: {{url: '{closed_port_url()}', probe_timeout_s: 1}}\n")
    broken = load_spec_text(MINIMAL + f"reward_endpoints:\n  rm: {{url: '{server.url}', health_url: "
                                      f"'{server.url.replace('/score', '/nope')}'}}\n")
    try:
        check_reward_endpoints(up.reward_endpoints)
        assert server.requests[0][0] == {"prompts": [], "completions": []}  # the probe: an empty batch
        with pytest.raises(SetupError, match=r"^reward_endpoints.rm.url: the reward endpoint 'rm' does not answer: "
                                             r"an empty batch POSTed to it failed: cannot reach http://127.0.0.1:\d+/"
                                             r"score: \[Errno 111\] Connection refused"):
            check_reward_endpoints(down.reward_endpoints)
        with pytest.raises(SetupError, match=r"^reward_endpoints.rm.health_url: .*answered HTTP 404"):
            check_reward_endpoints(broken.reward_endpoints)
        server.reply = b"<html>"
        with pytest.raises(SetupError, match=r"reward_endpoints.rm.url: .* is not JSON"):
            check_reward_endpoints(up.reward_endpoints)
    finally:
        REWARD_FUNCTIONS.pop("rm")
        REWARD_FUNCTIONS.pop("rm2", None)


def test_reward_pool_endpoint_reuses_its_connection_across_batches_and_retries():
    """One kept-alive connection carries every batch and the retry after a 503 (httpx's pool), where a client that
    opens a connection per request shows one port per POST."""
    server = RewardServer(keep_alive=True)
    rm = EndpointReward("rm", server.url, batch_size=2, max_retries=1, backoff_s=0.05)
    try:
        server.fail_next, server.status = 1, 503
        completions, answers = rows(6)
        assert rm(prompts=["q"] * 6, completions=completions, answer=answers) == [
            float(c == a) for c, a in zip(completions, answers)]
        assert len(server.requests) == 4  # three batches, the first one twice
        assert len(set(server.peers)) == 1, server.peers
        assert rm(prompts=["q"], completions=["1"], answer=["1"]) == [1.0]  # a later call: the same connection
        assert len(set(server.peers)) == 1, server.peers
    finally:
        rm.close()
        server.close()


def test_reward_pool_endpoint_dropped_connection_is_retried_with_backoff():
    """A connection closed without a reply (a service restarting) is a transport failure: retried after backoff_s,
    then 2 × backoff_s; once the attempts are spent the batch has no scores."""
    server = RewardServer(keep_alive=True)
    rm = EndpointReward("rm", server.url, max_retries=2, backoff_s=0.2)
    try:
        server.drop_next = 2
        t0 = time.monotonic()
        assert rm(prompts=["q", "q"], completions=["1", "2"], answer=["1", "1"]) == [1.0, 0.0]
        assert len(server.requests) == 3 and time.monotonic() - t0 >= 0.2 + 0.4
        server.drop_next = 3
        assert rm(prompts=["q"], completions=["1"], answer=["1"]) == [UNSCORED]
        assert len(server.requests) == 6
    finally:
        rm.close()
        server.close()


def test_reward_pool_endpoint_threads_share_one_client():
    """A reward pool's threads call one endpoint object at once: every thread gets its own rows' scores, over one
    client whose pool holds at most one connection per concurrent request."""
    from concurrent.futures import ThreadPoolExecutor

    server = RewardServer(keep_alive=True)
    rm = EndpointReward("rm", server.url, batch_size=3)
    try:
        def call(i):
            completions = [str(i + k) for k in range(6)]
            return rm(prompts=["q"] * 6, completions=completions, answer=[str(i)] * 6)

        with ThreadPoolExecutor(4) as threads:
            results = list(threads.map(call, range(8)))
        assert results == [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 8
        assert len(server.requests) == 16 and len(set(server.peers)) <= 4
    finally:
        rm.close()
        server.close()
