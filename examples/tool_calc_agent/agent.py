"""The calculator task of examples/tool_calc_cpu.yaml written as an agent with the openai client (docs/agents.md):
the model gets a calculator as an OpenAI tool (`tools=[...]`; the endpoint reads its `<tool_call>` text with the
hermes parser), the agent runs each call and answers with a `tool` message, and the model answers in a later turn.

    rollout: {agent: agent.py:run, agent_options: {max_turns: 3, max_tokens: 64}}   # examples/tool_calc_agent/spec.yaml

Kept as the `tools` environment runs the task, so that the two are comparable: the same system prompt and chat
template (the spec's data.chat_template, which the endpoint applies), at most 3 turns of 64 tokens, the tool's output
as `calculator: <result>` (or the error), and the same scorer (reasoning-gym's, on the episode's text: the replies,
their tool calls and the tool outputs). A reply without a tool call is the answer.

Reward: the scorer's 1 or 0 (`accuracy`, which held-out pass@1 reads); `tool_calls` and `tool_errors` (calls that
did not run: bad arguments, an unknown tool) say how the tool was used.
"""

import json

import openai

from grpo.environments.calculator import CalculatorError, calculate
from grpo.rewards import REWARD_FUNCTIONS

SYSTEM = ("You can use a calculator. To use it, write exactly\n"
          '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>\n'
          "and stop; its result comes back in the next message.\n"
          "When you know the answer, write it as the last line in the form '#### <number>'.")
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def calculator(call) -> tuple[bool, str]:
    """Run one tool call: (it ran, the tool message's text)."""
    if call.function.name != "calculator":
        return False, f"error: unknown tool {call.function.name!r}; available: calculator"
    try:
        return True, f"calculator: {calculate(json.loads(call.function.arguments)['expression'])}"
    except (CalculatorError, ValueError, KeyError, TypeError) as exc:
        return False, f"calculator: {exc}"


async def run(client, row, max_turns: int = 3, max_tokens: int = 64):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]}]
    text, calls, errors = [], 0, 0
    for turn in range(1, max_turns + 1):
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                         max_tokens=max_tokens)
        except openai.BadRequestError as exc:  # the episode's token budget is spent: score what it wrote
            if exc.code != "token_budget":
                raise
            break
        message = reply.choices[0].message
        text.append(message.content or "")
        text += [f'<tool_call>{{"name": "{c.function.name}", "arguments": {c.function.arguments}}}</tool_call>'
                 for c in message.tool_calls or []]
        if not message.tool_calls or turn == max_turns:
            break
        messages.append(message)
        for call in message.tool_calls:
            ran, output = calculator(call)
            calls, errors = calls + 1, errors + (not ran)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
            text.append(output)
    score = REWARD_FUNCTIONS["reasoning_gym"](["\n".join(text)], [row["reference"]])[0]
    return {"reward": score, "accuracy": score, "tool_calls": float(calls), "tool_errors": float(errors)}
