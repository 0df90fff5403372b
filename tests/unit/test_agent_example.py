"""The agent docs/agents.md shows is ``examples/agent/agent.py`` (30 lines with the ``openai`` client), its spec
validates, and the agent does what the page says on canned replies: 2 for a right first answer, 1 after a correction
(the wrong reply and the correction are in the second call's messages), 0 when both are wrong."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from types import SimpleNamespace

from cluster.agents.loading import check_agent_signature, load_agent
from cluster.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "agent"


def test_agent_docs_show_the_example_agent():
    page = (REPO / "docs" / "agents.md").read_text()
    shown = re.search(r"```python\n(import re\n.*?)```", page, re.S).group(1)
    source = (EXAMPLE / "agent.py").read_text()
    assert shown.strip() in source and len(source.splitlines()) <= 30


class CannedClient:
    """Answers call k with ``replies[k]`` and keeps the messages of every call."""

    def __init__(self, replies):
        self.replies, self.calls = list(replies), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, model, messages, max_tokens):
        self.calls.append([dict(m) for m in messages])
        text = self.replies[len(self.calls) - 1]
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=text))])


def test_agent_example_spec_validates_and_its_agent_scores_its_episodes():
    spec = load_spec(EXAMPLE / "spec.yaml")
    assert spec.rollout.agent == "agent.py:run" and spec.algorithm.rewards == {}
    run = load_agent("agent.py:run", EXAMPLE)
    assert check_agent_signature(run, "agent.py:run", spec.rollout.agent_options) is None
    row = {"prompt": "What is 29 - 14?", "answer": "15", "reference": "15"}
    first = CannedClient(["29 - 14 = 15\n15"])
    assert asyncio.run(run(first, row)) == {"accuracy": 1.0, "first_try": 1.0}
    second = CannedClient(["It is 13.", "Sorry: 15"])
    assert asyncio.run(run(second, row)) == {"accuracy": 1.0, "first_try": 0.0}
    assert second.calls[1][-2:] == [{"role": "assistant", "content": "It is 13."},
                                    {"role": "user", "content": "That is not right. Check your arithmetic and answer "
                                                                "again."}]
    assert asyncio.run(run(CannedClient(["12", "13"]), row)) == {"accuracy": 0.0, "first_try": 0.0}
