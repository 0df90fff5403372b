"""A tiny randomly initialised Llama with SmolLM2's real tokenizer, for fast tests of the real loop."""

from __future__ import annotations

import shutil
from pathlib import Path

TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True,
                   rms_norm_eps=1e-5)


def make_tiny_model(out_dir: str | Path, seed: int = 0) -> str:
    """Write a ~3.2M-parameter LlamaForCausalLM (vocab 49,152, tied embeddings) plus SmolLM2's tokenizer files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from cluster.loop.checkpoint_state import TOKENIZER_FILES
    from cluster.data.models import resolve_model_path

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return str(out)
    src = Path(resolve_model_path("builtin:SmolLM2-135M-Instruct"))
    base = AutoConfig.from_pretrained(src)
    config = AutoConfig.for_model("llama", vocab_size=base.vocab_size, bos_token_id=base.bos_token_id,
                                  eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id, **TINY_CONFIG)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    tmp.rename(out)
    return str(out)
