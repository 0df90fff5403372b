"""``train_workers.lora`` on an unsharded tiny Llama (no process group): the spec → PEFT config mapping, which
parameters train, HF names of the merged tensors, the merge against PEFT's ``merge_and_unload``, and the reference
context (adapters off = the base; ``requires_grad`` kept). The sharded, two-rank path is
``tests/distributed/test_lora_worker.py``."""

from __future__ import annotations

import pytest
import torch

from cluster.spec import LoraSpec


def _tiny(vocab: int = 512):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny_model import TINY_CONFIG

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=vocab, **TINY_CONFIG))


@pytest.mark.parametrize(("spec", "expected"), [
    (LoraSpec(rank=4), {"r": 4, "lora_alpha": 4, "lora_dropout": 0.0, "init_lora_weights": True}),
    (LoraSpec(rank=8, alpha=32, dropout=0.1, init="gaussian", target_modules=["q_proj"]),
     {"r": 8, "lora_alpha": 32.0, "lora_dropout": 0.1, "init_lora_weights": "gaussian", "target_modules": {"q_proj"}}),
])
def test_lora_config_maps_the_spec(spec, expected):
    from train_workers.lora import lora_config

    config = lora_config(spec, _tiny())
    for key, value in expected.items():
        assert getattr(config, key) == value, key
    assert config.bias == "none"


def test_lora_adapters_only_train_and_merge_like_peft():
    from train_workers.lora import LoraPolicy, add_adapters, hf_name, is_adapter

    hf = _tiny()
    hf_names = [n for n, _ in hf.named_parameters()]
    q_base = hf.model.layers[0].self_attn.q_proj.weight.detach().clone()
    peft_model = add_adapters(hf, LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "down_proj"]))
    named = dict(peft_model.named_parameters())
    assert {n for n, p in named.items() if p.requires_grad} == {n for n in named if is_adapter(n)}
    assert sum(map(is_adapter, named)) == 2 * 2 * 2  # 2 layers x (q_proj, down_proj) x (A, B)
    policy = LoraPolicy(peft_model, with_reference=True)
    assert policy.metrics()["actor/trainable_parameters"] == 2 * (4 * 64 + 64 * 4 + 4 * 128 + 64 * 4)
    with torch.no_grad():
        for n, p in named.items():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    sources = policy.merged_sources()
    assert [name for name, _, _ in sources] == hf_names  # the HF names, in order, tied head once
    assert hf_name("base_model.model.model.layers.1.mlp.down_proj.base_layer.weight") == \
        "model.layers.1.mlp.down_proj.weight"
    got = {name: gather() for name, _, gather in sources}
    assert all(tuple(got[name].shape) == shape for name, shape, _ in sources)
    merged = dict(peft_model.merge_and_unload().named_parameters())
    for name in hf_names:
        torch.testing.assert_close(got[name], merged[name].detach(), rtol=1e-6, atol=1e-7, msg=name)
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"], q_base)
    assert torch.equal(got["model.layers.0.self_attn.k_proj.weight"], hf.model.layers[0].self_attn.k_proj.weight)


def test_lora_adapters_off_is_the_base_and_keeps_adapters_trainable():
    from train_workers.lora import LoraPolicy, add_adapters

    base = _tiny()
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = base(input_ids=ids).logits
    peft_model = add_adapters(base, LoraSpec(rank=4, init="gaussian"))
    policy = LoraPolicy(peft_model, with_reference=True)
    with torch.no_grad():
        for p in policy.trainable:
            p.add_(0.05)  # B != 0: the adapters change the output
        adapted = peft_model(input_ids=ids).logits
        with policy.adapters_off():
            assert all(p.requires_grad for p in policy.trainable)
            off = peft_model(input_ids=ids).logits
    assert float((adapted - expected).abs().max()) > 1e-3
    torch.testing.assert_close(off, expected, rtol=0, atol=0)
    assert all(p.requires_grad for p in policy.trainable)


def test_lora_adapter_sources_are_pefts_saved_adapter_folder(tmp_path):
    """``adapter`` sync streams exactly what ``PeftModel.save_pretrained`` writes: the same tensor names and values
    (``adapter_model.safetensors``) and the same ``adapter_config.json``, so the engine's folder is a PEFT folder."""
    import json

    from safetensors.torch import load_file

    from train_workers.lora import LoraPolicy, add_adapters, saved_name

    peft_model = add_adapters(_tiny(), LoraSpec(rank=4, alpha=8))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    policy = LoraPolicy(peft_model, with_reference=False)
    sources = policy.adapter_sources()
    peft_model.save_pretrained(tmp_path, safe_serialization=True)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert sorted(name for name, _, _ in sources) == sorted(saved)
    assert len(sources) == 2 * 7 * 2  # 2 layers x 7 linear layers x (A, B)
    for name, shape, gather in sources:
        tensor = gather()
        assert tensor.dtype == torch.float32 and tuple(tensor.shape) == shape
        assert torch.equal(tensor, saved[name]), name
    assert saved_name("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert policy.adapter_config() == {**written, "target_modules": sorted(written["target_modules"])}
    assert policy.adapter_config()["r"] == 4 and policy.adapter_config()["lora_alpha"] == 8
