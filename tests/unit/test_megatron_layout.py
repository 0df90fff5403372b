"""Megatron layout rules: the spec's TP/PP/SP fields (cluster/spec/sections.py TrainSpec) and the model-dependent
checks of train_workers/megatron/config.py (check_megatron_layout), plus the pure QKV/fc1/vocab mappings of
train_workers/megatron/convert.py against hand-built tensors. Nothing here imports megatron-core."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.spec import SpecError, load_spec_text
from train_workers.megatron.config import MegatronLayoutError, check_megatron_layout
from train_workers.megatron.convert import fuse_qkv, hf_stage, pad_vocab, shard_fc1, split_qkv, unshard_fc1

REPO = Path(__file__).resolve().parents[2]

MINIMAL = """\
output_dir: runs/test
total_steps: 3
data:
  train_path: train.jsonl
rollout:
  max_response_tokens: 64
"""

SMOLLM2_135M = {  # HuggingFaceTB/SmolLM2-135M-Instruct config.json, the keys the checks read
    "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 576, "intermediate_size": 1536,
    "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": 49152,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 100000, "max_position_embeddings": 8192,
    "attention_bias": False, "mlp_bias": False,
}
QWEN25_05B = {  # Qwen/Qwen2.5-0.5B-Instruct config.json, the keys the checks read
    "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
    "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24, "vocab_size": 151936,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "use_sliding_window": False,
}


def load(*overrides: str):
    return load_spec_text(MINIMAL, source="job.yaml", overrides=overrides)


@pytest.fixture
def megatron_registered():
    """The spec accepts strategy 'megatron' now that its worker is registered (kept as a fixture for the tests
    below)."""
    from train_workers import registry

    assert registry.TRAIN_BACKENDS["megatron"] == "train_workers.megatron.worker:MegatronTrainWorker"


def test_megatron_defaults_keep_fsdp_layout():
    train = load().train
    assert (train.tensor_parallel_size, train.pipeline_parallel_size, train.sequence_parallel) == (1, 1, False)


def test_megatron_strategy_accepted_once_registered():
    train = load("train.strategy=megatron", "train.tensor_parallel_size=2", "train.world_size=2").train
    assert (train.strategy, train.tensor_parallel_size) == ("megatron", 2)


@pytest.mark.parametrize("override, field", [
    ("train.tensor_parallel_size=2", "train.tensor_parallel_size"),
    ("train.pipeline_parallel_size=2", "train.pipeline_parallel_size"),
    ("train.sequence_parallel=true", "train.sequence_parallel"),
])
def test_megatron_fields_refused_with_fsdp(override, field):
    with pytest.raises(SpecError, match=rf"{field}.*needs strategy 'megatron'; strategy 'fsdp'"):
        load("train.world_size=4", "train.strategy=fsdp", override)


@pytest.mark.parametrize("overrides", [
    ("train.tensor_parallel_size=2",), ("train.pipeline_parallel_size=2",),
    ("train.tensor_parallel_size=2", "train.sequence_parallel=true"),
])
def test_a_megatron_layout_implies_the_megatron_strategy_when_none_is_given(overrides):
    """``grpo-cluster validate SPEC --set train.tensor_parallel_size=2``: the layout implies the one model-parallel
    strategy instead of being refused for the default fsdp."""
    assert load("train.world_size=4", *overrides).train.strategy == "megatron"


@pytest.mark.parametrize("overrides, message", [
    (("train.world_size=4", "train.tensor_parallel_size=3"), r"train.tensor_parallel_size.*3 × 1 = 3 must divide "
                                                             r"train.world_size = 4"),
    (("train.world_size=6", "train.tensor_parallel_size=2", "train.pipeline_parallel_size=2"),
     r"train.tensor_parallel_size.*2 × 2 = 4 must divide train.world_size = 6"),
    (("train.world_size=2", "train.sequence_parallel=true"),
     r"train.sequence_parallel.*needs tensor_parallel_size > 1"),
])
def test_megatron_impossible_layouts_refused(megatron_registered, overrides, message):
    with pytest.raises(SpecError, match=message):
        load("train.strategy=megatron", *overrides)


def test_megatron_possible_layout_accepted(megatron_registered):
    train = load("train.strategy=megatron", "train.world_size=8", "train.tensor_parallel_size=2",
                 "train.pipeline_parallel_size=2", "train.sequence_parallel=true").train
    assert train.world_size // (train.tensor_parallel_size * train.pipeline_parallel_size) == 2


def test_megatron_layout_of_real_configs():
    smol = check_megatron_layout(SMOLLM2_135M, tp=3, pp=5)
    assert (smol.head_dim, smol.heads_per_group, smol.layers_per_stage) == (64, 3, 6)
    assert smol.padded_vocab_size == 49152  # already a multiple of 128 × 3
    assert smol.tied_embeddings and not smol.qkv_bias and smol.rope_theta == 100000
    qwen = check_megatron_layout(QWEN25_05B, tp=2, pp=4)
    assert qwen.qkv_bias and qwen.padded_vocab_size == 152064 and qwen.stage_layers(3) == range(18, 24)


@pytest.mark.parametrize("config, tp, pp, field, message", [
    (SMOLLM2_135M, 2, 1, "train.tensor_parallel_size", r"tensor_parallel_size=2 must divide .*num_attention_heads=9"),
    (QWEN25_05B, 7, 1, "train.tensor_parallel_size", r"tensor_parallel_size=7 must divide .*num_key_value_heads=2"),
    (SMOLLM2_135M, 1, 4, "train.pipeline_parallel_size", r"pipeline_parallel_size=4 must divide .*=30"),
    ({**SMOLLM2_135M, "architectures": ["GPT2LMHeadModel"]}, 1, 1, "architectures", r"expected one of"),
    ({**SMOLLM2_135M, "hidden_act": "gelu"}, 1, 1, "hidden_act", r"expected 'silu'"),
    ({**SMOLLM2_135M, "attention_bias": True}, 1, 1, "attention_bias", r"o_proj bias"),
    ({**SMOLLM2_135M, "mlp_bias": True}, 1, 1, "mlp_bias", r"expected false"),
    ({**QWEN25_05B, "use_sliding_window": True}, 1, 1, "use_sliding_window", r"expected false"),
    ({**SMOLLM2_135M, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 1, 1, "rope_scaling", r"no RoPE"),
])
def test_megatron_unsupported_layouts_name_the_field(config, tp, pp, field, message):
    with pytest.raises(MegatronLayoutError, match=message) as info:
        check_megatron_layout(config, tp=tp, pp=pp)
    assert info.value.field == field and str(info.value).startswith(field)


def test_megatron_rope_theta_from_transformers5_rope_parameters():
    config = {k: v for k, v in SMOLLM2_135M.items() if k != "rope_theta"}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0}
    assert check_megatron_layout(config).rope_theta == 50000.0


def test_megatron_qkv_fusion_interleaves_query_groups():
    """nq=4, G=2, d=1: rows per group are [q heads of the group, k, v] (attention.py get_query_key_value_tensors)."""
    layout = check_megatron_layout({**SMOLLM2_135M, "hidden_size": 4, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "head_dim": 1})
    q, k, v = torch.tensor([0., 1, 2, 3]), torch.tensor([10., 11]), torch.tensor([20., 21])
    fused = fuse_qkv(q, k, v, layout)
    assert fused.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert fused.chunk(2)[1].tolist() == [2, 3, 11, 21]  # tp=2: rank 1 holds query group 1 whole
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, layout), (q, k, v)))
    with pytest.raises(ValueError, match="expected 8 linear_qkv rows, got 7"):
        split_qkv(fused[:7], layout)


def test_megatron_fc1_shards_keep_gate_up_pairs():
    gate, up = torch.arange(4.0)[:, None], 10 + torch.arange(4.0)[:, None]
    shards = [shard_fc1(gate, up, 2, r) for r in range(2)]
    assert [s.flatten().tolist() for s in shards] == [[0, 1, 10, 11], [2, 3, 12, 13]]
    back = unshard_fc1(shards)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)


def test_megatron_vocab_padding_zero_rows():
    layout = check_megatron_layout({**SMOLLM2_135M, "vocab_size": 1000}, tp=3)
    padded = pad_vocab(torch.ones(1000, 2, dtype=torch.bfloat16), layout)
    assert padded.shape == (1152, 2) and padded.dtype == torch.bfloat16 and padded[1000:].abs().sum() == 0


def test_megatron_hf_stage_of_each_tensor():
    """SmolLM2-135M (30 layers, tied) at pp=3: 10 layers a stage, the embedding on the first, the norm last."""
    layout = check_megatron_layout(SMOLLM2_135M, 1, 3)
    assert hf_stage("model.embed_tokens.weight", layout) == 0
    assert [hf_stage(f"model.layers.{i}.mlp.up_proj.weight", layout) for i in (0, 9, 10, 19, 20, 29)] == [
        0, 0, 1, 1, 2, 2]
    assert hf_stage("model.norm.weight", layout) == hf_stage("lm_head.weight", layout) == 2
    for name in ("model.layers.30.input_layernorm.weight", "model.rotary_emb.inv_freq"):
        with pytest.raises(KeyError, match="not a tensor of the HF Llama/Qwen2 layout with 30 layers"):
            hf_stage(name, layout)


def test_megatron_layout_imports_no_megatron():
    # In a fresh interpreter: earlier tests of the same pytest process (tests/distributed) import megatron-core.
    code = ("import sys; import cluster.spec, train_workers.megatron.config, train_workers.megatron.convert; "
            "loaded = sorted(n for n in sys.modules if n == 'megatron' or n.startswith('megatron.')); "
            "assert not loaded, loaded")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def _hf_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under the HF Llama/Qwen2 names and shapes of ``config`` (float32)."""
    g = torch.Generator().manual_seed(seed)
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
        if "Qwen2ForCausalLM" in config["architectures"]:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    if config["tie_word_embeddings"]:
        del shapes["lm_head.weight"]
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=4, vocab_size=1100)


@pytest.mark.parametrize("config", [{**SMOLLM2_135M, **TINY}, {**QWEN25_05B, **TINY, "tie_word_embeddings": False}],
                         ids=["llama_tied", "qwen2_untied"])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4)])
def test_megatron_state_dict_round_trip_every_layout(config, tp, pp):
    """HF → every (pp_rank, tp_rank)'s Megatron state dict → HF is bit-exact; per-rank shapes follow the layout."""
    from train_workers.megatron.convert import hf_to_megatron, megatron_to_hf

    layout = check_megatron_layout(config, tp=tp, pp=pp)
    hf = _hf_state_dict(config)
    shards = {(p, t): hf_to_megatron(hf, layout, t, p) for p in range(pp) for t in range(tp)}
    back = megatron_to_hf(shards, layout)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    first, last = shards[(0, tp - 1)], shards[(pp - 1, tp - 1)]
    assert first["embedding.word_embeddings.weight"].shape == (layout.padded_vocab_size // tp, 64)
    assert first["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 16 // tp, 64)
    assert first["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 128 // tp, 64)
    assert first["decoder.layers.0.mlp.linear_fc2.weight"].shape == (64, 128 // tp)
    assert sorted(k for k in last if k.startswith("decoder.layers.")) == sorted(
        k for k in first if k.startswith("decoder.layers."))  # local layer names 0..L/pp-1 on every stage
    has_output = not layout.tied_embeddings or pp > 1  # tied: the last stage keeps a copy only when pp > 1
    assert ("output_layer.weight" in last) == has_output


@pytest.mark.parametrize("overrides, message", [
    # only the pipeline size breaks the layout: tp 1 (the default, never set) divides anything
    (("train.world_size=2", "train.pipeline_parallel_size=3"),
     r"--set train.pipeline_parallel_size, --set train.world_size: train.pipeline_parallel_size: .*1 × 3 = 3 "
     r"must divide "
     r"train.world_size = 2"),
    (("train.world_size=4", "train.tensor_parallel_size=2", "train.pipeline_parallel_size=3"),
     r"--set train.pipeline_parallel_size, --set train.world_size, --set train.tensor_parallel_size: "
     r"train.pipeline_parallel_size: .*2 × 3 = 6 must divide"),
])
def test_megatron_layout_refusal_names_the_pipeline_size_when_it_alone_does_not_divide(megatron_registered,
                                                                                       overrides, message):
    with pytest.raises(SpecError, match=message):
        load("train.strategy=megatron", *overrides)


@pytest.mark.parametrize("tp, pp, field", [
    (0, 1, "train.tensor_parallel_size"), (1, 0, "train.pipeline_parallel_size"),
    (-2, 1, "train.tensor_parallel_size")])
def test_megatron_layout_sizes_below_1_name_their_field(tp, pp, field):
    with pytest.raises(MegatronLayoutError, match=r">= 1") as info:
        check_megatron_layout(SMOLLM2_135M, tp=tp, pp=pp)
    assert info.value.field == field


@pytest.mark.parametrize("name", ["decoder.layers.0.self_attention.linear_proj.weight",
                                  "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
                                  "embedding.word_embeddings.weight"])
def test_megatron_param_to_hf_refuses_one_shard_of_a_tp_split_parameter(name):
    """One shard stands for the whole parameter only when it is replicated (the norms); a split one given as one
    shard came back as a part of the HF tensor, under its HF name, with no error."""
    from train_workers.megatron.convert import hf_to_megatron, megatron_param_to_hf

    config = {**SMOLLM2_135M, **TINY}
    layout = check_megatron_layout(config, tp=2)
    shard = hf_to_megatron(_hf_state_dict(config), layout, tp_rank=0)[name]
    with pytest.raises(ValueError, match=rf"{name}: .*split over tp=2 ranks: expected 2 shards, got 1"):
        megatron_param_to_hf(name, [shard], layout)
    norm = megatron_param_to_hf("decoder.layers.0.input_layernorm.weight", [torch.ones(64)], layout)
    assert norm[0][1].shape == (64,)


def test_megatron_layout_checked_by_the_driver_before_workers_start(tmp_path, megatron_registered):
    """``cluster.data.model_checks.check_train_layout`` (the trainer's pre-start check, before Ray starts) reaches the
    Megatron backend's ``check_layout`` through the registry and reports the field as a ModelError."""
    import json

    from cluster.data.models import ModelError
    from cluster.data.model_checks import check_train_layout

    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_135M))
    spec = load("train.strategy=megatron", "train.tensor_parallel_size=3", "train.world_size=3")
    check_train_layout(spec.train, str(tmp_path), "float32")  # 9 heads, 3 kv heads: tp=3 fits
    bad = load("train.strategy=megatron", "train.tensor_parallel_size=2", "train.world_size=2")
    with pytest.raises(ModelError, match=r"train\.tensor_parallel_size: tensor_parallel_size=2 must divide"):
        check_train_layout(bad.train, str(tmp_path), "float32")
    check_train_layout(load().train, str(tmp_path / "missing"), "float32")  # fsdp: nothing to check
