"""Padding-free packing: packed logprobs equal unpacked and left-padded HF logprobs; layout, placeholders, errors.

Shapes as in ``train_workers.packing``: n sequences, L packed tokens, M response tokens, T = max response length.
"""

from __future__ import annotations

import random

import pytest
import torch

from cluster.loop.scheduler import plan_microbatches
from grpo.advantages import compute_advantages
from grpo.logprobs import logprobs_from_logits
from train_workers.packing import (
    VARLEN_SDPA,
    PackedMicroBatch,
    empty_microbatch,
    pack_microbatch,
    pack_rank_microbatches,
    register_varlen_sdpa,
)
from train_workers.policy import ResponseLogprobModel

ATOL = 1e-5

# Three (prompt, response) pairs of different lengths; token ids inside SmolLM2's 49,152-token vocabulary.
PROMPTS = [[1, 504, 3_000, 77, 12_345], [42, 9], [7, 8, 9, 10, 11, 12, 13, 14]]
RESPONSES = [[2_222, 3_333, 4_444], [100, 200, 300, 400, 500, 600], [49_000]]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.use_cache = False
    return model.eval()


def _behaviour(responses):
    return [torch.zeros(len(r)) for r in responses]


def _packed_logprobs(model: ResponseLogprobModel, prompts, responses) -> torch.Tensor:
    """[n, T] response logprobs of one packed micro-batch (0 under the mask's zeros)."""
    mb = pack_microbatch(prompts, responses, [0.0] * len(prompts), _behaviour(responses), range(len(prompts)))
    with torch.no_grad():
        lp, ent = model(mb.input_ids, mb.position_ids, mb.logit_positions, mb.targets)
    assert lp.shape == ent.shape == (sum(len(r) for r in responses),)
    return mb.to_padded(lp)


def _left_padded_logprobs(hf, prompts, responses, pad_id: int = 0) -> list[torch.Tensor]:
    """Per-sequence response logprobs from one left-padded batch through the plain HF model."""
    rows = [list(p) + list(r) for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows) + 3  # extra padding even on the longest row
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        start = width - len(p) - len(r)
        pos = torch.arange(start + len(p) - 1, start + len(p) + len(r) - 1)
        out.append(logprobs_from_logits(logits[i, pos], torch.tensor(r)))
    return out


def test_packed_equals_alone_equals_left_padded(hf_model):
    model = ResponseLogprobModel(hf_model, temperature=1.0)
    packed = _packed_logprobs(model, PROMPTS, RESPONSES)
    padded = _left_padded_logprobs(hf_model, PROMPTS, RESPONSES)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        alone = _packed_logprobs(model, [p], [r])[0]
        assert alone.shape == (len(r),)
        torch.testing.assert_close(packed[i, : len(r)], alone, rtol=0, atol=ATOL)
        torch.testing.assert_close(packed[i, : len(r)], padded[i], rtol=0, atol=ATOL)
        assert torch.all(packed[i, len(r):] == 0)
    assert torch.all(packed <= 0)


def test_neighbours_do_not_leak_into_a_packed_sequence(hf_model):
    """Sequences packed *before* a sequence must not change its logprobs (block-diagonal attention)."""
    model = ResponseLogprobModel(hf_model, temperature=1.0)
    p, r = PROMPTS[0], RESPONSES[0]
    a = _packed_logprobs(model, [PROMPTS[1], p], [RESPONSES[1], r])[1, : len(r)]
    b = _packed_logprobs(model, [[5, 6, 7], PROMPTS[2], p], [[8, 9], RESPONSES[2], r])[2, : len(r)]
    torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
    # Control: the same row through a plain causal pass (positions not restarting) does see the prefix.
    row = torch.tensor([PROMPTS[1] + RESPONSES[1] + p + r])
    with torch.no_grad():
        logits = hf_model(input_ids=row, use_cache=False).logits[0]
    start = len(PROMPTS[1]) + len(RESPONSES[1])
    pos = torch.arange(start + len(p) - 1, start + len(p) + len(r) - 1)
    leaked = logprobs_from_logits(logits[pos], torch.tensor(r))
    assert (leaked - a).abs().max() > 1e-4


def test_varlen_attention_packed_equals_alone_equals_left_padded(hf_model):
    model = ResponseLogprobModel(hf_model, temperature=1.0)
    sdpa_packed = _packed_logprobs(model, PROMPTS, RESPONSES)
    padded = _left_padded_logprobs(hf_model, PROMPTS, RESPONSES)  # plain sdpa with an attention mask
    before = hf_model.config._attn_implementation
    hf_model.config._attn_implementation = register_varlen_sdpa()
    try:
        assert register_varlen_sdpa() == VARLEN_SDPA  # idempotent
        packed = _packed_logprobs(model, PROMPTS, RESPONSES)
        neighbours = _packed_logprobs(model, [[5, 6, 7]] + PROMPTS[::-1], [[8, 9]] + RESPONSES[::-1])
        with pytest.raises(ValueError, match="padded inputs .* are not supported"):
            _left_padded_logprobs(hf_model, PROMPTS, RESPONSES)
    finally:
        hf_model.config._attn_implementation = before
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        torch.testing.assert_close(packed[i, : len(r)], sdpa_packed[i, : len(r)], rtol=0, atol=ATOL)
        torch.testing.assert_close(packed[i, : len(r)], padded[i], rtol=0, atol=ATOL)
        torch.testing.assert_close(neighbours[3 - i, : len(r)], packed[i, : len(r)], rtol=0, atol=ATOL)


def test_varlen_attention_gradients_match_sdpa(hf_model):
    model = ResponseLogprobModel(hf_model, temperature=1.0)
    mb = pack_microbatch(PROMPTS, RESPONSES, [1.0, -1.0, 0.5], _behaviour(RESPONSES), [0, 1, 2])
    grads = []
    before = hf_model.config._attn_implementation
    for impl in (before, register_varlen_sdpa()):
        hf_model.config._attn_implementation = impl
        hf_model.zero_grad(set_to_none=True)
        lp, _ = model(mb.input_ids, mb.position_ids, mb.logit_positions, mb.targets)
        (mb.to_padded(lp) * mb.advantages[:, None]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in hf_model.named_parameters()})
    hf_model.config._attn_implementation = before
    hf_model.zero_grad(set_to_none=True)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_temperature_logprobs_are_log_softmax_of_scaled_logits(hf_model):
    tau = 0.7
    model = ResponseLogprobModel(hf_model, temperature=tau)
    p, r = PROMPTS[0], RESPONSES[0]
    lp = _packed_logprobs(model, [p], [r])[0]
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([p + r]), use_cache=False).logits[0]
    pos = torch.arange(len(p) - 1, len(p) + len(r) - 1)
    expected = torch.log_softmax(logits[pos].double() / tau, dim=-1)[torch.arange(len(r)), torch.tensor(r)]
    torch.testing.assert_close(lp.double(), expected, rtol=0, atol=ATOL)
    at_one = torch.log_softmax(logits[pos].double(), dim=-1)[torch.arange(len(r)), torch.tensor(r)]
    assert (lp.double() - at_one).abs().max() > 1e-3  # the temperature is really applied


def test_gradients_flow_through_packed_logprobs(hf_model):
    model = ResponseLogprobModel(hf_model, temperature=1.0)
    mb = pack_microbatch(PROMPTS, RESPONSES, [1.0, -1.0, 0.5], _behaviour(RESPONSES), [0, 1, 2])
    hf_model.zero_grad(set_to_none=True)
    lp, _ = model(mb.input_ids, mb.position_ids, mb.logit_positions, mb.targets)
    (mb.to_padded(lp) * mb.advantages[:, None]).sum().backward()
    grads = [p.grad for p in hf_model.parameters()]
    assert all(g is not None for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    hf_model.zero_grad(set_to_none=True)


def test_layout():
    behaviour = [torch.tensor([-0.1, -0.2, -0.3]), torch.tensor([-1.0]), torch.tensor([-2.0, -3.0])]
    mb = pack_microbatch([[10, 11], [20], [30, 31, 32]], [[12, 13, 14], [21], [33, 34]], [0.5, -1.0, 2.0],
                         behaviour, [7, 3, 5])
    assert isinstance(mb, PackedMicroBatch)
    assert mb.num_sequences == 3 and mb.num_tokens == 5 + 2 + 5
    assert mb.input_ids.tolist() == [[10, 11, 12, 13, 14, 20, 21, 30, 31, 32, 33, 34]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3, 4]]
    assert mb.input_ids.dtype == mb.position_ids.dtype == torch.int64
    # Response token t of sequence i is predicted by the logits one position before it.
    assert mb.logit_positions.tolist() == [1, 2, 3, 5, 9, 10]
    assert mb.targets.tolist() == [12, 13, 14, 21, 33, 34]
    assert mb.input_ids[0, mb.logit_positions + 1].tolist() == mb.targets.tolist()
    assert mb.token_seq.tolist() == [0, 0, 0, 1, 2, 2]
    assert mb.token_pos.tolist() == [0, 1, 2, 0, 0, 1]
    assert mb.response_mask.tolist() == [[True, True, True], [True, False, False], [True, True, False]]
    assert mb.advantages.tolist() == [0.5, -1.0, 2.0] and mb.advantages.dtype == torch.float32
    assert mb.seq_indices.tolist() == [7, 3, 5]
    torch.testing.assert_close(mb.behaviour_logprobs,
                               torch.tensor([[-0.1, -0.2, -0.3], [-1.0, 0.0, 0.0], [-2.0, -3.0, 0.0]]))
    values = torch.arange(1.0, 7.0, requires_grad=True)
    padded = mb.to_padded(values)
    assert padded.tolist() == [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0]]
    padded.sum().backward()  # to_padded keeps autograd
    assert values.grad.tolist() == [1.0] * 6


def test_empty_microbatch(hf_model):
    mb = empty_microbatch()
    assert mb.num_sequences == 0 and mb.num_tokens == 1
    assert mb.input_ids.shape == mb.position_ids.shape == (1, 1)
    assert mb.logit_positions.numel() == mb.targets.numel() == 0
    assert mb.to_padded(torch.zeros(0)).shape == (0, 0)
    assert pack_microbatch([], [], [], [], []).num_sequences == 0
    # The placeholder still runs forward/backward through every parameter and contributes exactly zero gradient.
    model = ResponseLogprobModel(hf_model, temperature=1.0)
    hf_model.zero_grad(set_to_none=True)
    lp, ent = model(mb.input_ids, mb.position_ids, mb.logit_positions, mb.targets)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() * 0.0).backward()
    grads = [p.grad for p in hf_model.parameters()]
    assert all(g is not None and torch.all(g == 0) for g in grads)
    hf_model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(response_ids=[[1]]), "2 prompts, 1 responses"),
    (dict(advantages=[0.0]), "1 advantages"),
    (dict(behaviour_logprobs=[torch.zeros(1)]), "1 logprob rows"),
    (dict(seq_indices=[0]), "1 indices"),
    (dict(prompt_ids=[[1], []]), "sequence 1 has an empty prompt or response"),
    (dict(response_ids=[[1], []], behaviour_logprobs=[torch.zeros(1), torch.zeros(0)]),
     "sequence 1 has an empty prompt or response"),
    (dict(behaviour_logprobs=[torch.zeros(1), torch.zeros(3)]), "sequence 1 has 2 response tokens but 3"),
    (dict(group_ids=[4]), "got 1 group ids for 2 sequences"),
])
def test_errors(kwargs, match):
    args = dict(prompt_ids=[[1, 2], [3]], response_ids=[[4], [5, 6]], advantages=[0.0, 1.0],
                behaviour_logprobs=[torch.zeros(1), torch.zeros(2)], seq_indices=[0, 1])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        pack_microbatch(**args)


def test_group_ids_default_and_given():
    args = ([[1, 2], [3]], [[4], [5, 6]], [0.0, 1.0], [torch.zeros(1), torch.zeros(2)], [0, 1])
    assert pack_microbatch(*args).group_ids.tolist() == [-1, -1]
    mb = pack_microbatch(*args, group_ids=[9, 4])
    assert mb.group_ids.tolist() == [9, 4] and mb.group_ids.dtype == torch.int64
    assert empty_microbatch().group_ids.shape == (0,)


def test_group_ids_and_advantages_survive_any_reordering():
    """Advantages computed per group before planning stay with their sequence through a shuffle of the rows and
    whatever order the planner puts them in; recomputing them from the shuffled rows (explicit group ids) agrees."""
    rng = random.Random(3)
    num_groups, group_size = 12, 4
    group_ids = torch.tensor([100 + g for g in range(num_groups) for _ in range(group_size)])
    rewards = torch.tensor([float(rng.random() < 0.4) + 0.1 * rng.random() for _ in range(len(group_ids))])
    advantages = compute_advantages(rewards, group_ids, "grpo")
    lengths = [rng.randint(5, 300) for _ in group_ids]
    for seed in range(5):
        order = list(range(len(group_ids)))
        random.Random(seed).shuffle(order)
        shuffled_adv = compute_advantages(rewards[order], group_ids[order], "grpo")
        torch.testing.assert_close(shuffled_adv, advantages[order], rtol=0, atol=1e-6)
        plan = plan_microbatches([lengths[i] for i in order], 3, 400)
        prompts = [[1] * (lengths[i] // 2) for i in order]
        responses = [[2] * (lengths[i] - lengths[i] // 2) for i in order]
        per_rank = pack_rank_microbatches(plan.ranks, prompts, responses, shuffled_adv,
                                          [torch.zeros(len(r)) for r in responses], group_ids=group_ids[order])
        seen = []
        for mbs in per_rank:
            for mb in mbs:
                for k, gid, adv in zip(mb.seq_indices.tolist(), mb.group_ids.tolist(), mb.advantages.tolist()):
                    original = order[k]
                    seen.append(original)
                    assert gid == int(group_ids[original])
                    assert adv == pytest.approx(float(advantages[original]), abs=1e-6)
                    assert mb.num_tokens >= lengths[original]
        assert sorted(seen) == list(range(len(group_ids)))


@pytest.mark.slow
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-5, 1e-5), (torch.float64, 2e-5, 0.0)])
def test_packed_equals_alone_equals_left_padded_smollm2(gsm8k_train_path, dtype, atol, rtol):
    """The same parity on the real SmolLM2-135M-Instruct (30 layers) with real chat prompts and GSM8K answers.

    fp32: within 1e-5 + 1e-5·|logprob| (measured max 2.3e-5 on a logprob of ≈ −2, i.e. 1.1e-5 relative: 30 layers
    of fp32 rounding in different GEMM shapes; the tiny model meets 1e-5 absolute). fp64 model: within 2e-5
    absolute (measured max 5.4e-6 on the varlen path, 5.5e-7 relative): transformers' ``LlamaRMSNorm`` and rotary
    embedding compute in float32 even for a float64 model, so fp64 runs still carry fp32 rounding in those two ops.
    Both bounds stay 5x below what a leak does (attention crossing sequences or into padding moves logprobs by
    > 1e-4: ``test_neighbours_do_not_leak_into_a_packed_sequence``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.data import build_chat_prompt, load_jsonl_examples
    from cluster.data.models import resolve_model_path
    from cluster.spec import DEFAULT_SYSTEM_PROMPT

    path = resolve_model_path("builtin:SmolLM2-135M-Instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    examples, _ = load_jsonl_examples(gsm8k_train_path)
    prompts, responses = [], []
    for ex in examples[:3]:
        text = tokenizer.apply_chat_template(build_chat_prompt(ex, DEFAULT_SYSTEM_PROMPT), tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        responses.append(tokenizer(ex.answer, add_special_tokens=False)["input_ids"][:40])
    model = ResponseLogprobModel(hf, temperature=1.0)
    packed = _packed_logprobs(model, prompts, responses)
    padded = _left_padded_logprobs(hf, prompts, responses, pad_id=tokenizer.pad_token_id or 0)
    hf.config._attn_implementation = register_varlen_sdpa()
    varlen = _packed_logprobs(model, prompts, responses)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        alone = _packed_logprobs(model, [p], [r])[0]
        torch.testing.assert_close(packed[i, : len(r)], alone, rtol=rtol, atol=atol)
        torch.testing.assert_close(varlen[i, : len(r)], alone, rtol=rtol, atol=atol)
        torch.testing.assert_close(packed[i, : len(r)], padded[i], rtol=rtol, atol=atol)


@pytest.mark.parametrize("flash_installed", [True, False])
def test_packed_attention_dispatch(monkeypatch, flash_installed):
    """flash-attention only on CUDA, when installed, for float16/bfloat16 compute; float32 (which flash-attention
    refuses) and CPU take the varlen SDPA path."""
    import importlib.util

    from train_workers.packing import VARLEN_SDPA, packed_attention

    assert packed_attention(False, torch.bfloat16) == VARLEN_SDPA  # imports transformers before find_spec is faked
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        (object() if flash_installed else None) if name == "flash_attn" else real(name, *a)))
    flash = "flash_attention_2" if flash_installed else VARLEN_SDPA
    assert packed_attention(True, torch.float32) == VARLEN_SDPA
    assert packed_attention(True, torch.bfloat16) == flash
    assert packed_attention(True, torch.float16) == flash
    for dtype in (torch.float32, torch.bfloat16):
        assert packed_attention(False, dtype) == VARLEN_SDPA
