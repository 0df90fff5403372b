"""The ``train.lora`` spec section (issue 16): absent means full fine-tuning; bad values are refused before Ray starts,
naming the field — by pydantic (rank <= 0, unknown or repeated keys, ``adapter`` sync of a rank vLLM cannot
serve) or by the model checks ``validate``/``run`` make (target module names the model lacks, listing those it has;
a rank larger than a targeted layer; the LM head)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli import main
from cluster.data.models import ModelError
from cluster.data.model_checks import check_lora
from cluster.spec import LoraSpec, SpecError, load_spec, load_spec_text, spec_to_yaml
from tests.unit.test_cli_validate import _spec_file

EXAMPLE = Path(__file__).resolve().parents[2] / "tests" / "tiny_cpu.yaml"


def test_lora_absent_or_null_is_full_fine_tuning_and_round_trips():
    spec = load_spec(EXAMPLE)
    assert spec.train.lora is None
    assert load_spec(EXAMPLE, ["train.lora=null"]).train.lora is None
    lora = load_spec(EXAMPLE, ["train.lora.rank=8", "train.lora.alpha=16"])
    assert lora.train.lora == LoraSpec(rank=8, alpha=16.0)
    assert lora.train.lora.target_modules == "all-linear" and lora.train.lora.sync == "merged"
    assert lora.train.lora.init == "standard" and lora.train.lora.scaling == 2.0
    assert LoraSpec(rank=4).scaling == 1.0  # alpha null: alpha = rank
    assert load_spec_text(spec_to_yaml(lora)) == lora
    listed = load_spec(EXAMPLE, ["train.lora.rank=8", "train.lora.target_modules=[q_proj, v_proj]"])
    assert listed.train.lora.target_modules == ["q_proj", "v_proj"]
    assert load_spec_text(spec_to_yaml(listed)) == listed
    text = EXAMPLE.read_text().replace("  lr: 1.0e-5\n", "  lr: 1.0e-5\n  lora: {rank: 8, scale: 2}\n")
    with pytest.raises(SpecError, match=r"train.lora.scale: unknown key 'scale'; allowed: rank, alpha"):
        load_spec_text(text)


@pytest.mark.parametrize(("sets", "field", "message"), [
    (["train.lora.rank=0"], "train.lora.rank", "greater than or equal to 1"),
    (["train.lora.rank=-4"], "train.lora.rank", "greater than or equal to 1"),
    (["train.lora.alpha=16"], "train.lora.rank", "required key 'rank' is missing"),
    (["train.lora.rank=8", "train.lora.alpha=0"], "train.lora.alpha", "greater than 0"),
    (["train.lora.rank=8", "train.lora.dropout=1.0"], "train.lora.dropout", "less than 1"),
    (["train.lora.rank=8", "train.lora.target_modules=[]"], "train.lora.target_modules", "non-empty list"),
    (["train.lora.rank=8", "train.lora.target_modules=[q_proj, q_proj]"], "train.lora.target_modules",
     "each module name once"),
    (["train.lora.rank=8", "train.lora.target_modules=attention"], "train.lora.target_modules",
     "expected 'all-linear' or a list of module names, got 'attention'"),
    (["train.lora.rank=8", "train.lora.target_modules=[q_proj, 3]"], "train.lora.target_modules", "got [3]"),
    (["train.lora.rank=8", "train.lora.init=pissa"], "train.lora.init", "'standard' or 'gaussian'"),
    (["train.lora.rank=1024", "train.lora.sync=adapter"], "train.lora.sync",
     "vLLM serves LoRA adapters of rank at most 512 (its largest max_lora_rank); train.lora.rank is 1024"),
])
def test_lora_spec_refusals_name_the_field(sets, field, message):
    with pytest.raises(SpecError) as info:
        load_spec(EXAMPLE, sets)
    text = str(info.value)
    assert f"--set {field}: " in text or f": {field}: " in text, text
    assert message in text, text


def test_lora_adapter_sync_is_accepted_up_to_the_engines_max_rank():
    spec = load_spec(EXAMPLE, ["train.lora.rank=8", "train.lora.sync=adapter"])
    assert spec.train.lora.sync == "adapter"
    assert load_spec(EXAMPLE, ["train.lora.rank=512", "train.lora.sync=adapter"]).train.lora.rank == 512
    assert load_spec(EXAMPLE, ["train.lora.rank=1024"]).train.lora.sync == "merged"  # merged: any rank the model fits


def test_lora_engine_rank_is_vllms_smallest_max_lora_rank_that_holds_it():
    pytest.importorskip("vllm")
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    from cluster.spec.lora import ENGINE_MAX_LORA_RANK
    from rollout_workers.vllm.config import engine_lora_rank

    assert ENGINE_MAX_LORA_RANK == max(get_args(MaxLoRARanks))
    assert [engine_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match=r"^train.lora.rank: expected at most 512 .* got 513$"):
        engine_lora_rank(513)


def test_lora_model_checks_accept_what_the_model_has(tiny_model_dir):
    for targets in ("all-linear", ["q_proj", "v_proj"], ["self_attn.o_proj", "down_proj"]):
        check_lora(LoraSpec(rank=32, target_modules=targets), tiny_model_dir)
    check_lora(None, tiny_model_dir)  # full fine-tuning: nothing to check


def test_lora_unknown_target_module_lists_what_exists(tiny_model_dir):
    with pytest.raises(ModelError) as info:
        check_lora(LoraSpec(rank=4, target_modules=["q_proj", "query"]), tiny_model_dir)
    assert str(info.value) == ("train.lora.target_modules: 'query' matches no linear layer of the model; it has "
                               "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (or 'all-linear')")


def test_lora_head_and_oversized_rank_are_refused(tiny_model_dir):
    with pytest.raises(ModelError, match=r"^train.lora.target_modules: 'lm_head' is the output head"):
        check_lora(LoraSpec(rank=4, target_modules=["lm_head"]), tiny_model_dir)
    # The tiny Llama's k_proj is 64 -> 32 (one KV head of 32): rank 33 does not fit it, but fits q_proj (64 x 64).
    check_lora(LoraSpec(rank=64, target_modules=["q_proj"]), tiny_model_dir)
    with pytest.raises(ModelError) as info:
        check_lora(LoraSpec(rank=33), tiny_model_dir)
    assert str(info.value) == ("train.lora.rank: expected rank <= 32, the smaller dimension of targeted layer "
                               "model.layers.0.self_attn.k_proj (in 64, out 32), got 33")
    with pytest.raises(ModelError, match=r"^train.lora.rank: expected rank <= 64"):
        check_lora(LoraSpec(rank=65, target_modules=["q_proj"]), tiny_model_dir)


def test_validate_refuses_lora_that_does_not_fit_the_model(tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = _spec_file(tmp_path, tiny_model_dir)
    assert main(["validate", str(spec), "--set", "train.lora.rank=8", "--set",
                 "train.lora.target_modules=[q_proj, wq]"]) == 2
    err = capsys.readouterr().err
    assert "--set train.lora.target_modules: 'wq' matches no linear layer" in err, err
    assert main(["validate", str(spec), "--set", "train.lora.rank=40"]) == 2
    assert "--set train.lora.rank: expected rank <= 32" in capsys.readouterr().err
    assert main(["validate", str(spec), "--set", "train.lora.rank=8"]) == 0


def test_lora_resume_refuses_a_checkpoint_of_another_kind(tmp_path):
    import json

    from cluster.loop.checkpoint_state import check_policy_kind
    from cluster.loop.setup import SetupError

    full, adapters = tmp_path / "full", tmp_path / "lora"
    full.mkdir()
    adapters.mkdir()
    (full / "config.json").write_text("{}")
    (adapters / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    check_policy_kind(full, None)
    check_policy_kind(adapters, LoraSpec(rank=8, alpha=16))
    with pytest.raises(SetupError, match=r"^train.lora: .*/lora is a LoRA checkpoint \(adapters only\) but this spec"):
        check_policy_kind(adapters, None)
    with pytest.raises(SetupError, match=r"^train.lora: .*/full is a full fine-tuning checkpoint, not LoRA adapters"):
        check_policy_kind(full, LoraSpec(rank=8))
    with pytest.raises(SetupError, match=r"holds adapters of rank 8, alpha 16; this spec asks for rank 8, alpha 8;"):
        check_policy_kind(adapters, LoraSpec(rank=8))


def test_lora_adapter_sync_checks_vllms_lora_support_for_the_architecture(tiny_model_dir, monkeypatch):
    pytest.importorskip("vllm")
    from vllm.model_executor.models import interfaces

    check_lora(LoraSpec(rank=8, sync="adapter"), tiny_model_dir)  # LlamaForCausalLM serves LoRA in vLLM
    monkeypatch.setattr(interfaces, "supports_lora", lambda cls: False)  # an architecture without LoRA support
    with pytest.raises(ModelError, match=r"^train.lora.sync: 'adapter' needs an engine that serves LoRA adapters, "
                                         r"but vLLM's LlamaForCausalLM \(architecture LlamaForCausalLM\) has no LoRA"):
        check_lora(LoraSpec(rank=8, sync="adapter"), tiny_model_dir)
    check_lora(LoraSpec(rank=8), tiny_model_dir)  # merged works with any engine
