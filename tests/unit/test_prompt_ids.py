"""Exactly one BOS, and the same prompt ids for training, eval and the engine, with a Llama-3-style tokenizer (chat
template writes BOS, post-processor adds it again). Issue #12: `eval` tokenized the templated text with special
tokens (two BOS) and handed vLLM text prompts, which vLLM tokenizes with special tokens again.

The tokenizer is real (SmolLM2's, rebuilt locally by ``tests/double_bos.py``); vLLM's LLM is replaced by a recorder,
so this checks what each path hands the engine."""

from __future__ import annotations

import json
import sys
import threading
import types
from pathlib import Path

import pytest

from cluster.data import chat_prompt_ids, load_jsonl_examples
from tests.stand_ins import stand_in_job
from cluster.data.evaluate import evaluate_gsm8k
from cluster.spec import DEFAULT_SYSTEM_PROMPT, load_spec_text
from contract.messages import GroupRequest
from rollout_workers.vllm.engine import VLLMEngine
from rollout_workers.vllm.serving import VLLMServer
from tests.double_bos import BOS, make_double_bos_model

SUFFIX = "\nAnswer with a number."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model_dir) -> str:
    return make_double_bos_model(tiny_model_dir, tmp_path_factory.mktemp("models") / "double_bos")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "rows.jsonl"
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def train_ids(tokenizer, data) -> list[list[int]]:
    examples, _ = load_jsonl_examples(data)
    return chat_prompt_ids(tokenizer, examples, DEFAULT_SYSTEM_PROMPT, SUFFIX)


def test_the_tokenizer_writes_bos_twice_when_asked_naively(tokenizer):
    """The fixture really is Llama-3 style: without this the other tests could pass on any tokenizer."""
    bos = tokenizer.convert_tokens_to_ids(BOS)
    assert tokenizer.bos_token_id == bos
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.startswith(BOS)
    assert tokenizer(text)["input_ids"][:3].count(bos) == 2  # what eval did before


def test_chat_prompt_ids_have_exactly_one_bos_first(tokenizer, train_ids, data):
    bos = tokenizer.bos_token_id
    assert len(train_ids) == 4
    for ids in train_ids:
        assert ids[0] == bos and ids.count(bos) == 1
    examples, _ = load_jsonl_examples(data)
    messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                {"role": "user", "content": examples[0].question + SUFFIX}]
    hf = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert train_ids[0] == list(hf)  # the same ids as HF's own templated tokenization
    assert chat_prompt_ids(tokenizer, [], None) == []


def test_driver_trains_on_the_same_ids(tmp_path, model_dir, data, train_ids):
    spec = load_spec_text(f"output_dir: {tmp_path / 'out'}\ntotal_steps: 1\nmodel: {{path: {model_dir}}}\n"
                          f"data: {{train_path: {data}, prompt_suffix: {json.dumps(SUFFIX)}}}\n"
                          f"metrics: {{port: null}}\n")
    job = stand_in_job(spec, progress=False)
    try:
        assert [job.prompt_ids[i] for i in range(4)] == train_ids
    finally:
        job.close()


class RecordingLLM:
    """Stands in for vllm.LLM: records the prompts and echoes their ids as the prompt it saw, with one completion.
    ``prepend`` simulates an engine that adds a token of its own to the prompt."""

    def __init__(self, prepend: list[int] | None = None, **kwargs):
        self.kwargs, self.prompts, self.prepend, self.lora_requests = kwargs, [], prepend or [], []

    def generate(self, prompts, params, use_tqdm, lora_request=None):
        self.prompts.extend(prompts)
        self.lora_requests.append(lora_request)
        comp = types.SimpleNamespace(text="so #### 0", token_ids=[5, 6], finish_reason="stop",
                                     logprobs=[{5: types.SimpleNamespace(logprob=-0.5)},
                                               {6: types.SimpleNamespace(logprob=-0.25)}])
        return [types.SimpleNamespace(prompt_token_ids=self.prepend + list(p["prompt_token_ids"]), outputs=[comp])
                for p in prompts]


@pytest.fixture
def fake_vllm(monkeypatch) -> dict:
    """vllm with LLM → RecordingLLM; SamplingParams and TokensPrompt (a TypedDict in vLLM) as plain dicts."""
    built: dict = {}

    def make_llm(**kwargs):
        built["llm"] = RecordingLLM(**kwargs)
        return built["llm"]

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = make_llm, (lambda **kwargs: kwargs)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kwargs: dict(kwargs)
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(name, raising=False)
    return built


def test_eval_hands_the_engine_the_training_ids(model_dir, data, train_ids, fake_vllm):
    result = evaluate_gsm8k(model_dir, str(data), max_tokens=8, prompt_suffix=SUFFIX)
    assert result["n"] == 4
    assert fake_vllm["llm"].prompts == [{"prompt_token_ids": ids} for ids in train_ids]  # token prompts, no text
    assert fake_vllm["llm"].kwargs["max_model_len"] == max(map(len, train_ids)) + 8


def _engine(llm) -> VLLMEngine:
    """A VLLMEngine around ``llm`` without starting vLLM (its __init__ builds the real engine)."""
    engine = object.__new__(VLLMEngine)
    engine.llm, engine.policy_version, engine.kv_capacity_tokens, engine.lora_request = llm, 3, None, None
    engine.rollout = types.SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_response_tokens=8,
                                           stop=[])
    engine._engine_lock, engine._interrupted_epoch = threading.Lock(), -1
    engine.server = VLLMServer(engine)  # request-level serving: idle (its thread starts with a first request)
    return engine


def test_engine_samples_from_the_training_ids(train_ids, fake_vllm):
    llm = RecordingLLM()
    results, _ = _engine(llm).generate([GroupRequest(i, ids) for i, ids in enumerate(train_ids)], 1)
    assert llm.prompts == [{"prompt_token_ids": ids} for ids in train_ids]
    assert [r.prompt_ids for r in results] == train_ids
    assert llm.lora_requests == [None]  # full-weight sync: the engine's own weights are the policy


def test_engine_with_lora_adapter_sync_sends_the_policys_adapter_with_every_request(train_ids, fake_vllm):
    llm = RecordingLLM()
    engine = _engine(llm)
    engine.lora_request = adapter = types.SimpleNamespace(lora_name="policy-v3", lora_int_id=4)
    engine.generate([GroupRequest(0, train_ids[0])], 2)
    engine.generate([GroupRequest(i, ids) for i, ids in enumerate(train_ids)], 1)
    assert llm.lora_requests == [adapter, adapter]


def test_engine_refuses_a_prompt_it_changed(tokenizer, train_ids, fake_vllm):
    """An engine that adds its own BOS would sample from a prompt training never scores."""
    llm = RecordingLLM(prepend=[tokenizer.bos_token_id])
    with pytest.raises(RuntimeError, match=r"group 0: the engine's prompt \(\d+ tokens\) is not the prompt training"):
        _engine(llm).generate([GroupRequest(0, train_ids[0])], 1)
