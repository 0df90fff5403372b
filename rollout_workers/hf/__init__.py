"""The ``hf`` rollout engine (``rollout.engine: hf``): ``engine`` (:class:`HFEngine`), ``sampling`` (the KV-cached
decode loop with vLLM's seeds, filters, logprobs and stop strings), ``model`` (loading, LoRA adapters, sync targets).
Needs torch and transformers only (PEFT for LoRA adapter sync)."""
