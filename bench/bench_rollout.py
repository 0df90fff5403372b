"""Rollout throughput: the same GRPO sampling batch through the vLLM engine and through HF ``generate``.

What is measured: B GSM8K prompts (the first B rows of the train file, the spec's default system prompt, the
tokenizer's chat template with the generation prompt, tokenized as the driver does), G samples each, temperature 1.0,
top-p 1.0 (no top-k), at most T new tokens, on SmolLM2-135M-Instruct in float32.

(a) vLLM: :class:`rollout_workers.vllm.engine.VLLMEngine` built in this process (its engine core runs in a process vLLM
    spawns) from a :class:`cluster.spec.RolloutSpec`. Engine start-up is timed and reported separately; one warm-up
    ``generate`` of the same batch runs first, then the prefix cache is reset (GRPO prompts are new every step, so the
    timed call must not hit cached prompt blocks). Timed: the wall-clock of one ``VLLMEngine.generate`` call (B
    requests with ``SamplingParams(n=G)``, per-token logprobs included, as in training).
(b) HF transformers: ``AutoModelForCausalLM.generate`` on the whole batch at once (left-padded, attention mask,
    ``do_sample=True``, ``num_return_sequences=G``, KV cache on) with ``torch.set_num_threads(--hf-threads)``
    (default 2). A 2-token warm-up call runs first (untimed). Timed: the wall-clock of one ``generate`` call.

Generated tokens = the completions' tokens up to and including EOS (HF rows keep decoding padding after EOS until the
whole batch is done; those steps are paid for but not counted). Both engines sample independently, so their token
counts differ a little; tokens/s is the comparable number. HF runs first, then vLLM, so the two never compete for the
cores.

Noise: the script prints the load average. On a 2-core machine that other processes are using, multi-threaded torch
(HF with 2 threads) degrades far more than single-threaded work (OpenMP threads wait on each other at every op):
measured here under load ≈ 8, one HF forward took ~1.3 s with 1 thread and ~22 s with 2 threads. Compare
``--hf-threads 1`` when the machine is busy.

Usage (from the repo root)::

    .venv/bin/python -m bench.bench_rollout                     # B=8, G=4, T=64
    .venv/bin/python -m bench.bench_rollout --quick             # B=2, G=2, T=16: a correctness smoke run
    .venv/bin/python -m bench.bench_rollout -B 16 -G 4 -T 128 --skip-hf
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from bench._common import DEFAULT_GSM8K, DEFAULT_MODEL, load_note, print_json, print_table, resolve_model


def build_prompts(tokenizer, data_path: str, batch: int, offset: int = 0) -> list[list[int]]:
    """Token ids of ``batch`` chat prompts (rows ``offset..offset+batch`` of the file), built as the driver does
    (`cluster.data.chat_prompt_ids`)."""
    from cluster.data import chat_prompt_ids, load_jsonl_examples
    from cluster.spec import DEFAULT_SYSTEM_PROMPT

    examples, _ = load_jsonl_examples(data_path)
    return chat_prompt_ids(tokenizer, examples[offset:offset + batch], DEFAULT_SYSTEM_PROMPT)


def run_hf(model_path: str, prompts: list[list[int]], group: int, max_tokens: int, threads: int, seed: int,
           eos_id: int, pad_id: int) -> dict:
    """Batched, left-padded HF ``generate``; returns load/warm-up/timed numbers."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=group,
                  pad_token_id=pad_id, eos_token_id=eos_id)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, **kwargs)
        warmup_s = time.perf_counter() - t0
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, **kwargs)
        seconds = time.perf_counter() - t0
    new = out[:, width:]
    lengths = []
    for row in new.tolist():
        lengths.append(row.index(eos_id) + 1 if eos_id in row else len(row))
    tokens = sum(lengths)
    del model
    gc.collect()
    return {"load_s": load_s, "warmup_s": warmup_s, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "decode_steps": int(new.shape[1]),
            "mean_len": statistics.mean(lengths), "truncated": sum(n == max_tokens and eos_id not in r
                                                                   for n, r in zip(lengths, new.tolist())),
            "sequences": len(lengths)}


def shutdown_engine(engine) -> None:
    """Stop vLLM's engine-core process now (instead of at interpreter exit, which logs a spurious warning)."""
    try:
        engine.llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # best effort: the process exits anyway
        print(f"(engine shutdown: {exc!r})")
    del engine
    gc.collect()


def run_vllm(model_path: str, prompts: list[list[int]], group: int, max_tokens: int, seed: int,
             kv_cache_gib: float, max_model_len: int) -> dict:
    """VLLMEngine: start-up, one warm-up generate, prefix-cache reset, one timed generate."""
    from cluster.spec import RolloutSpec
    from contract.messages import GroupRequest
    from rollout_workers.vllm.engine import VLLMEngine

    spec = RolloutSpec(prompts_per_step=len(prompts), group_size=group, temperature=1.0, top_p=1.0,
                       max_response_tokens=max_tokens, kv_cache_gib=kv_cache_gib, max_model_len=max_model_len,
                       enforce_eager=True)
    t0 = time.perf_counter()
    engine = VLLMEngine(model_path, spec, dtype="float32", seed=seed, max_model_len=max_model_len)
    startup_s = time.perf_counter() - t0
    requests = [GroupRequest(group_id=i, prompt_ids=p) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    engine.generate(requests, group)
    warmup_s = time.perf_counter() - t0
    engine.llm.reset_prefix_cache()
    t0 = time.perf_counter()
    results, stats = engine.generate(requests, group)
    seconds = time.perf_counter() - t0
    lengths = [len(r) for g in results for r in g.response_ids]
    truncated = sum(reason == "length" for g in results for reason in g.finish_reasons)
    shutdown_engine(engine)
    gc.collect()
    return {"startup_s": startup_s, "warmup_s": warmup_s, "tokens": stats.tokens, "seconds": seconds,
            "engine_seconds": stats.seconds, "tokens_per_s": stats.tokens / seconds,
            "mean_len": statistics.mean(lengths), "truncated": truncated, "sequences": len(lengths)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-B", "--prompts", type=int, default=8, help="B: prompts in the batch")
    parser.add_argument("-G", "--group-size", type=int, default=4, help="G: samples per prompt (>= 2)")
    parser.add_argument("-T", "--max-tokens", type=int, default=64, help="T: max new tokens per sample")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="builtin alias, HF folder or hub id")
    parser.add_argument("--data", default=str(DEFAULT_GSM8K), help="GSM8K-style jsonl")
    parser.add_argument("--hf-threads", type=int, default=2, help="torch threads for HF generate")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM CPU KV cache (GiB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke run: B=2, G=2, T=16")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.group_size, args.max_tokens = 2, 2, 16

    from transformers import AutoTokenizer

    load_start = load_note()
    model_path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = build_prompts(tokenizer, args.data, args.prompts)
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    longest = max(len(p) for p in prompts)
    max_model_len = max(512, -(-(longest + args.max_tokens) // 256) * 256)
    B, G, T = args.prompts, args.group_size, args.max_tokens
    print(f"model={model_path}\nB={B} prompts x G={G} samples, T={T} max new tokens, temperature 1.0; "
          f"prompt tokens mean {statistics.mean(map(len, prompts)):.0f} (max {longest})", flush=True)

    hf = vllm = None
    if not args.skip_hf:
        hf = run_hf(model_path, prompts, G, T, args.hf_threads, args.seed, eos_id, pad_id)
        print(f"hf done: {hf['tokens']} tokens in {hf['seconds']:.2f}s", flush=True)
    if not args.skip_vllm:
        vllm = run_vllm(model_path, prompts, G, T, args.seed, args.kv_cache_gib, max_model_len)
        print(f"vllm done: {vllm['tokens']} tokens in {vllm['seconds']:.2f}s", flush=True)

    rows = []
    if vllm:
        rows.append(["vLLM (VLLMEngine)", vllm["sequences"], vllm["tokens"], vllm["mean_len"], vllm["truncated"],
                     vllm["seconds"], vllm["tokens_per_s"], f"start {vllm['startup_s']:.1f}s, warm-up "
                                                            f"{vllm['warmup_s']:.1f}s"])
    if hf:
        rows.append([f"HF generate ({args.hf_threads} thr)", hf["sequences"], hf["tokens"], hf["mean_len"],
                     hf["truncated"], hf["seconds"], hf["tokens_per_s"],
                     f"load {hf['load_s']:.1f}s, {hf['decode_steps']} decode steps"])
    print()
    print_table(["engine", "seqs", "gen tokens", "mean len", "hit T", "seconds", "tokens/s", "not timed"], rows)
    ratio = vllm["tokens_per_s"] / hf["tokens_per_s"] if (vllm and hf) else None
    if ratio is not None:
        print(f"\nvLLM / HF tokens/s: {ratio:.2f}x")
    load_end = load_note()
    print(f"machine: {load_end['cpus']} CPUs, load average {load_start['loadavg_1m']} at start, "
          f"{load_end['loadavg_1m']} at end (above ~{load_end['cpus']}, other processes shared the cores)")
    print_json("rollout", {"B": B, "G": G, "T": T, "prompt_tokens_max": longest, "hf_threads": args.hf_threads,
                           "vllm": vllm, "hf": hf, "vllm_over_hf": ratio,
                           "machine": {"start": load_start, "end": load_end}})


if __name__ == "__main__":
    main()
