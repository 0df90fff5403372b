"""An agent written against the OpenAI chat API (docs/agents.md): it asks the model an arithmetic question, checks
the last number of the reply against the row's answer, and when it is wrong says so and lets the model try again.

    rollout: {agent: agent.py:run, agent_options: {tries: 2}}       # examples/agent/spec.yaml

Its reward: 1 for a right answer, plus 1 more when it came at the first try (a dict: each part is logged as
reward/<name>, the reward is their sum; held-out accuracy reads the 'accuracy' part).
"""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
SYSTEM = "Answer the question. End with the number alone on the last line."


def last_number(text: str) -> str | None:
    found = NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


async def run(client, row, tries: int = 2, max_tokens: int = 64):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]}]
    for attempt in range(1, tries + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)
        text = reply.choices[0].message.content or ""
        if last_number(text) == row["answer"]:
            return {"accuracy": 1.0, "first_try": float(attempt == 1)}
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": "That is not right. Check your arithmetic and answer again."}]
    return {"accuracy": 0.0, "first_try": 0.0}
