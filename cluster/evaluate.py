"""GSM8K pass@1 of a model folder with the vLLM engine (greedy decoding, one sample per problem).

    grpo-cluster eval --model runs/gsm8k_smollm2_cpu/checkpoints/step_000010 --data ../shared/data/gsm8k/test.jsonl
"""

from __future__ import annotations

import os
import time

from cluster.data import build_chat_prompt, load_jsonl_examples
from cluster.spec import DEFAULT_SYSTEM_PROMPT
from grpo.rewards.gsm8k import accuracy_reward, format_reward


def evaluate_gsm8k(model: str, data: str, limit: int | None = None, max_tokens: int = 256,
                   system_prompt: str | None = DEFAULT_SYSTEM_PROMPT, kv_cache_gib: int = 2) -> dict:
    """Greedy pass@1 on the first ``limit`` rows of a GSM8K jsonl file.

    Returns:
        ``{"pass@1", "format", "n", "mean_tokens", "truncated", "seconds", "tokens_per_s"}`` (fractions in [0, 1]).
    """
    import torch

    from cluster.models import resolve_model_path

    path = resolve_model_path(model)
    examples, _ = load_jsonl_examples(data)
    examples = examples[:limit] if limit else examples
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.apply_chat_template(build_chat_prompt(e, system_prompt), tokenize=False,
                                       add_generation_prompt=True) for e in examples]
    llm = LLM(model=path, dtype="float32" if not torch.cuda.is_available() else "auto", enforce_eager=True,
              max_model_len=1024 + max_tokens, gpu_memory_utilization=0.2 if not torch.cuda.is_available() else 0.5,
              seed=0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=True)
    seconds = time.perf_counter() - t0
    texts = [o.outputs[0].text for o in outs]
    n_tokens = [len(o.outputs[0].token_ids) for o in outs]
    acc = [accuracy_reward(t, e.answer) for t, e in zip(texts, examples)]
    fmt = [format_reward(t) for t in texts]
    n = len(examples)
    return {
        "pass@1": sum(acc) / n, "format": sum(fmt) / n, "n": n,
        "mean_tokens": sum(n_tokens) / n,
        "truncated": sum(o.outputs[0].finish_reason == "length" for o in outs) / n,
        "seconds": seconds, "tokens_per_s": sum(n_tokens) / max(seconds, 1e-9),
    }
