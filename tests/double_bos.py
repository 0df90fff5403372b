"""A model folder whose tokenizer is built like Llama 3's: the chat template writes BOS and the post-processor adds
BOS again to anything tokenized with special tokens. Built locally from the tiny model's SmolLM2 tokenizer (no hub)."""

from __future__ import annotations

import shutil
from pathlib import Path

BOS = "<|endoftext|>"
"""SmolLM2's id-0 special token, which its chat template never writes: here it plays Llama 3's <|begin_of_text|>."""


def make_double_bos_model(src_dir: str | Path, out_dir: str | Path) -> str:
    """Copy the HF folder ``src_dir`` to ``out_dir`` with its tokenizer given ``BOS`` as bos token, a
    ``TemplateProcessing`` post-processor that prepends it, and a chat template that starts with ``{{ bos_token }}``.

    Returns:
        ``out_dir`` as a str (left as is when it already holds a model).
    """
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return str(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src_dir, tmp)
    tok = AutoTokenizer.from_pretrained(tmp)
    bos_id = tok.convert_tokens_to_ids(BOS)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)])
    tok.bos_token = BOS
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return str(out)
