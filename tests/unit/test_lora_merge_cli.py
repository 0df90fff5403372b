"""``grpo-cluster merge CKPT --out DIR``: a LoRA checkpoint's adapters merged into its base model as an HF folder that
``transformers`` loads, equal to PEFT's own ``merge_and_unload``; refusals exit 2. The adapter folder here is written
by PEFT itself (nonzero B), as the train worker writes it (``tests/distributed/test_lora_worker.py`` covers that
path end to end)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cluster.cli import main


def _adapter_folder(model_dir: str, out: Path) -> dict[str, torch.Tensor]:
    """Save a rank-4 adapter on q_proj/v_proj with random A and B (nonzero delta) and the tokenizer files; return
    PEFT's merged weights of it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights="gaussian", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    peft_model.save_pretrained(out)
    shutil.copy2(Path(model_dir) / "tokenizer.json", out / "tokenizer.json")
    return {n: p.detach().clone() for n, p in peft_model.merge_and_unload().named_parameters()}


def test_lora_merge_writes_a_transformers_folder_equal_to_peft_merge(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "step_000002"
    expected = _adapter_folder(tiny_model_dir, ckpt)
    assert json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"] == tiny_model_dir
    out = tmp_path / "merged"
    assert main(["merge", str(ckpt), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    got = dict(merged.named_parameters())
    assert got.keys() == expected.keys() and not any("lora" in n or "base_layer" in n for n in got)
    for name, value in expected.items():
        torch.testing.assert_close(got[name].detach(), value, rtol=0, atol=0, msg=name)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q], dict(base.named_parameters())[q])  # the adapters are in it
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()


def test_lora_merge_refusals_exit_2(tiny_model_dir, tmp_path, capsys):
    assert main(["merge", tiny_model_dir, "--out", str(tmp_path / "m")]) == 2
    assert "no adapter_config.json: not a LoRA checkpoint" in capsys.readouterr().err
    ckpt = tmp_path / "ckpt"
    _adapter_folder(tiny_model_dir, ckpt)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert main(["merge", str(ckpt), "--out", str(busy)]) == 2
    assert f"{busy} exists and is not an empty folder" in capsys.readouterr().err
    assert main(["merge", str(ckpt), "--out", str(tmp_path / "m2"), "--base", str(tmp_path / "nope")]) == 2
    assert "base model folder" in capsys.readouterr().err and not (tmp_path / "m2").exists()


def test_lora_checkpoint_as_a_model_path_says_to_merge_it(tiny_model_dir, tmp_path):
    from cluster.data.models import ModelError, resolve_model_path

    ckpt = tmp_path / "step_000001"
    _adapter_folder(tiny_model_dir, ckpt)
    with pytest.raises(ModelError, match=r"it is a LoRA checkpoint \(adapters only\): write the merged model with "
                                         r"`grpo-cluster merge .*step_000001 --out DIR`"):
        resolve_model_path(str(ckpt))
