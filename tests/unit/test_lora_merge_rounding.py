"""Merged LoRA sync in a low-precision engine dtype (issue 30, item 3): the merged tensor is made from the float32
master weights into a fresh tensor, so 100 merge cycles leave the base bit-identical (where merge-then-unmerge in
place on bfloat16 weights drifts, shown as the contrast), and the rounding of the update is measured as documented
(``train_workers.lora.MergeRounding``): ‖cast(W + sBA) − W − sBA‖ / ‖sBA‖ (the engine's weights against the
trainer's, in units of the update) and ‖cast(W + sBA) − cast(W) − sBA‖ / ‖sBA‖ (the part of the update lost): ≈ 1
when the update is below bfloat16's resolution at W, 0 when it is exactly representable, tiny in float32."""

from __future__ import annotations

import math

import pytest
import torch

from train_workers.fsdp_sync import FSDPSyncSource
from train_workers.lora import ADAPTER, LoraPolicy, MergeRounding, add_adapters, merge_to


def test_rounding_error_matches_hand_computed_values():
    w = torch.ones(2, 2)
    a = torch.ones(1, 2)  # Δ = s·B·A: row i of Δ is s·b_i twice
    for b, scaling, want in (
            (torch.full((2, 1), 0.0005), 1.0, 1.0),  # Δ = 0.0005 < 2^-8, half bf16's spacing at 1: rounded away
            (torch.full((2, 1), 0.125), 2.0, 0.0),   # Δ = 0.25: 1.25 is on the bf16 grid
            (torch.tensor([[0.25], [0.0005]]), 1.0, math.sqrt(2 * 0.0005 ** 2 / (2 * 0.25 ** 2 + 2 * 0.0005 ** 2)))):
        rounding = MergeRounding()
        merged = merge_to(w, a, b, scaling, torch.bfloat16, rounding)
        assert merged.dtype == torch.bfloat16 and rounding.tensors == 1
        assert rounding.relative_error == pytest.approx(want, rel=1e-3, abs=1e-12)
        assert rounding.update_error == rounding.relative_error  # W = 1 is on the bf16 grid: the two agree
    exact = MergeRounding()
    merge_to(w, a, torch.full((2, 1), 0.0005), 1.0, torch.float32, exact)
    assert exact.relative_error < 1e-3 and exact.update_error < 1e-3  # float32 keeps it (spacing 2^-23 at 1)
    off_grid = MergeRounding()  # W = 1 + 2^-12 is not a bf16 value: its own rounding counts in the first ratio only
    merge_to(torch.full((2, 2), 1 + 2 ** -12), a, torch.full((2, 1), 0.25), 1.0, torch.bfloat16, off_grid)
    assert off_grid.update_error == 0.0 and off_grid.relative_error == pytest.approx(2 ** -12 / 0.25, rel=1e-6)
    assert MergeRounding().relative_error is None  # no update measured yet
    none = MergeRounding()
    merge_to(w, a, torch.zeros(2, 1), 1.0, torch.bfloat16, none)
    assert none.relative_error is None  # B = 0: nothing to lose


def _policy(tiny_model_dir: str) -> LoraPolicy:
    from transformers import AutoModelForCausalLM

    from cluster.spec import LoraSpec

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return LoraPolicy(add_adapters(hf, LoraSpec(rank=4, alpha=8.0)), with_reference=False)


def test_merged_sync_never_touches_the_base_over_100_cycles(tiny_model_dir):
    policy = _policy(tiny_model_dir)
    source = FSDPSyncSource(_Holder(policy.peft_model), policy)
    params = dict(policy.peft_model.named_parameters())
    base = {n: p.detach().clone() for n, p in params.items() if not any(k in n for k in ("lora_A", "lora_B"))}
    gen = torch.Generator().manual_seed(0)
    errors = []
    for cycle in range(100):
        with torch.no_grad():
            for p in policy.trainable:  # an update of the adapters, as an optimizer step would make
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
        sources = source.sources(torch.bfloat16)
        merged = {name: gather() for name, _, gather in sources}
        assert all(t.dtype == torch.bfloat16 for t in merged.values())
        errors.append(source.merge_rounding())
    for name, before in base.items():
        assert torch.equal(params[name].detach(), before), f"{name} changed"
    assert not any(getattr(m, "merged", False) for m in policy.peft_model.modules())
    assert all(e is not None and e[0] > 0 and e[1] > 0 for e in errors)  # (relative, update) error of each sync
    # the contrast: PEFT's merge-then-unmerge in place, on bfloat16 base weights, drifts the base
    layer = next(m for m in policy.peft_model.modules() if hasattr(m, "merge") and hasattr(m, "lora_A"))
    layer.to(torch.bfloat16)
    w0 = layer.base_layer.weight.detach().clone()
    for _ in range(100):
        layer.merge(adapter_names=[ADAPTER])
        layer.unmerge()
    assert not torch.equal(layer.base_layer.weight.detach(), w0)


def test_a_small_update_rounds_away_in_bfloat16_not_in_float32(tiny_model_dir):
    policy = _policy(tiny_model_dir)
    source = FSDPSyncSource(_Holder(policy.peft_model), policy)
    with torch.no_grad():
        for p in policy.trainable:
            if ".lora_B." in next(n for n, q in policy.peft_model.named_parameters() if q is p):
                p.fill_(1e-5)  # s·BA ≈ 1e-5 · Σ|A| ≪ bf16's spacing at |W| ≈ 0.02
    # bfloat16: at least the update's own size (the tiny model's float32 W is off the bf16 grid, so elements near a
    # rounding boundary also jump a whole grid step: more than 1); float32 keeps it
    for dtype, low, high in ((torch.bfloat16, 0.5, math.inf), (torch.float32, 0.0, 1e-2)):
        for _, _, gather in source.sources(dtype):
            gather()
        _, lost = source.merge_rounding()
        assert low <= lost < high, dtype


class _Holder:
    """A stand-in for ``ResponseLogprobModel`` (``.model``: the PEFT model), all FSDPSyncSource reads here."""

    def __init__(self, model):
        self.model = model
