"""``grpo-cluster merge CKPT --out DIR [--base MODEL]``: turn a LoRA checkpoint (a PEFT adapter folder, ``train.lora``)
into a full Hugging Face model folder, the base model with the adapters merged in (``W + (alpha/r)·B·A``), which
``transformers``, vLLM and ``grpo-cluster eval`` load like any model. The work is
``train_workers.lora_checkpoint.merge_lora_checkpoint``.

Exit codes: 0 written; 2 ``CKPT`` is not a LoRA checkpoint, the base model is missing, or ``DIR`` is not empty.
"""

from __future__ import annotations

import sys


def _cmd_merge(args) -> int:
    from train_workers.lora_checkpoint import merge_lora_checkpoint

    try:
        out = merge_lora_checkpoint(args.checkpoint, args.out, base=args.base)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"grpo-cluster merge: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def add_merge_command(sub) -> None:
    """Add ``merge`` to the ``grpo-cluster`` subparsers ``sub``."""
    p = sub.add_parser("merge", help="write a LoRA checkpoint's adapters merged into its base model as an HF folder")
    p.add_argument("checkpoint", help="a LoRA checkpoint folder (holds adapter_config.json)")
    p.add_argument("--out", required=True, help="the HF model folder to write (must not exist or be empty)")
    p.add_argument("--base", default=None, help=(
        "the base model folder; default: base_model_name_or_path in the checkpoint's adapter_config.json"))
    p.set_defaults(func=_cmd_merge)
