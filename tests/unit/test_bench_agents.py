"""``bench/bench_agents.py``'s own arithmetic (its engine runs are measured by hand, docs/results.md): tool latencies
the same for both designs and within 0.1–2 s, the summary's episodes/s and idle fraction, and the sleeping tool
environment's episode shape."""

from __future__ import annotations

import pytest

from bench.bench_agents import ENVIRONMENT, OBSERVATION, register_sleeping_tool, summary, tool_latencies


def test_bench_agents_latencies_are_seeded_and_within_the_range():
    table = tool_latencies(16, 4)
    assert table == tool_latencies(16, 4) and len(table) == 16 and all(len(row) == 4 for row in table)
    assert all(0.1 <= s <= 2.0 for row in table for s in row) and table != tool_latencies(16, 4, seed=1)


def test_bench_agents_summary_is_the_median_of_the_runs():
    runs = [{"wall_s": 4.0, "busy_s": 1.0, "episodes": [[1, 2], [3]]},
            {"wall_s": 2.0, "busy_s": 1.5, "episodes": [[1, 2], [3]]}]
    out = summary(runs, episodes=8)
    assert out["episodes_per_s"] == pytest.approx((2.0 + 4.0) / 2)  # median of 8/4 and 8/2
    assert out["engine_idle_fraction"] == pytest.approx((0.75 + 0.25) / 2) and out["sampled_tokens"] == 3


def test_bench_agents_sleeping_tool_answers_then_ends_the_episode():
    from grpo.environments import ENVIRONMENTS, make_environment
    from grpo.environments.base import Turn

    register_sleeping_tool([[0.0, 0.0]])
    try:
        env = make_environment(ENVIRONMENT, {})
        env.reset({"reference": "0"})
        first = env.step(Turn(text="x", token_ids=(1,), index=1, finish_reason="length"))
        last = env.step(Turn(text="y", token_ids=(2,), index=2, finish_reason="length"))
        assert (first.text, first.done, last.done) == (OBSERVATION, False, True)
    finally:
        ENVIRONMENTS.pop(ENVIRONMENT, None)


def test_bench_agents_shapes_are_parsed_or_refused_naming_the_flag():
    from bench.bench_agents import parse_shapes

    assert parse_shapes("16x4x24, 8x6x12") == [(16, 4, 24), (8, 6, 12)]
    with pytest.raises(ValueError, match=r"^--shapes: expected NxKxT with positive integers .* got '16x4'$"):
        parse_shapes("16x4")


def test_bench_agents_tool_bound_is_the_rounds_wait_over_the_slowest_episodes():
    from bench.bench_agents import tool_bound

    # lock-step waits 2 + 2 (each round's slowest tool); request-level the slowest episode's own 2.1 s
    assert tool_bound([[2.0, 0.1], [0.1, 2.0]]) == pytest.approx(4.0 / 2.1)
    assert tool_bound([[2.0, 2.0], [0.1, 0.1]]) == pytest.approx(1.0)  # one episode is slowest every round
    # an episode that ended waits for nothing in later rounds: 2 + 1 against the longest episode's 2.1 s
    assert tool_bound([[2.0], [0.1, 1.0]]) == pytest.approx(3.0 / 2.0)


def test_bench_agents_varied_turns_draw_each_episodes_count_from_one_to_k():
    table = tool_latencies(64, 4, varied=True)
    counts = [len(row) for row in table]
    assert table == tool_latencies(64, 4, varied=True) and set(counts) == {1, 2, 3, 4}
    assert all(0.1 <= s <= 2.0 for row in table for s in row)
