"""Hugging Face (Llama / Qwen2) ⇄ Megatron-core (local layer spec) state-dict mapping, as pure tensor functions.

Shapes: H hidden size, L layers, nq attention heads, G query groups (= HF ``num_key_value_heads``), d head dim,
F MLP intermediate size, V vocabulary, Vp padded vocabulary (:class:`~train_workers.megatron.config.MegatronLayout`),
tp / pp the tensor / pipeline parallel sizes. Every tensor keeps its dtype; nothing is cast, so HF → Megatron → HF is
bit-exact.

Megatron names (``GPTModel`` with ``get_gpt_layer_local_spec(normalization="RMSNorm")``, megatron-core 0.16.1; the
Transformer-Engine spec instead fuses the norms into ``linear_qkv.layer_norm_weight`` and
``linear_fc1.layer_norm_weight``):

====================================================  =================================================  ============
Megatron (per rank)                                   HF                                                 TP split
====================================================  =================================================  ============
embedding.word_embeddings.weight [Vp/tp, H]           model.embed_tokens.weight [V, H] (+ zero pad rows)  vocab rows
decoder.layers.{l}.input_layernorm.weight [H]         model.layers.{i}.input_layernorm.weight             replicated
decoder.layers.{l}.self_attention.linear_qkv.weight   q_proj [nq·d, H], k_proj, v_proj [G·d, H]          query groups
  [(nq + 2G)·d / tp, H]  (+ .bias for Qwen2)            (+ q/k/v biases)
decoder.layers.{l}.self_attention.linear_proj.weight  model.layers.{i}.self_attn.o_proj.weight [H, nq·d]  columns
  [H, nq·d / tp]
decoder.layers.{l}.pre_mlp_layernorm.weight [H]       model.layers.{i}.post_attention_layernorm.weight    replicated
decoder.layers.{l}.mlp.linear_fc1.weight [2F/tp, H]   gate_proj [F, H], up_proj [F, H]                    gate & up rows
decoder.layers.{l}.mlp.linear_fc2.weight [H, F/tp]    model.layers.{i}.mlp.down_proj.weight [H, F]        columns
decoder.final_layernorm.weight [H]                    model.norm.weight                                   replicated
output_layer.weight [Vp/tp, H]                        lm_head.weight [V, H] (untied), the embedding (tied)  vocab rows
====================================================  =================================================  ============

``l`` is the stage-local layer index, ``i = l + pp_rank · L/pp`` the global one (even split,
``get_transformer_layer_offset`` in ``megatron/core/transformer/transformer_block.py``). The embedding lives on the
first stage; the final norm and output layer on the last; with tied embeddings and pp == 1 there is no
``output_layer.weight`` (``share_embeddings_and_output_weights``), with pp > 1 the last stage holds a copy of the
embedding as ``output_layer.weight`` (``LanguageModule.setup_embeddings_and_output_layer``).

Sources of the layouts:
- ``linear_qkv`` rows are grouped per query group: [q heads of group g (nq/G · d rows), k_g (d), v_g (d)] for g in
  0..G-1 — ``SelfAttention.get_query_key_value_tensors`` in ``megatron/core/transformer/attention.py`` views the output
  as [s, b, G, (nq/G + 2) · d] and splits it so; Megatron-Bridge's ``QKVMapping`` (``merge_qkv_weights``) writes the
  same. A column-parallel split of these rows gives each TP rank G/tp whole groups.
- ``linear_fc1`` is [gate; up] per TP shard: ``MLP.forward``'s ``glu`` (``megatron/core/transformer/mlp.py``) does
  ``torch.chunk(x, 2, dim=-1)`` on the rank's own output and applies the activation to the first half; so shard r is
  [gate rows of r; up rows of r] (Megatron-Bridge ``GatedMLPMapping``).
- Column-parallel layers (``ColumnParallelLinear``, ``VocabParallelEmbedding``) split dim 0 into tp contiguous chunks;
  row-parallel ones (``RowParallelLinear``) split dim 1 (``megatron/core/tensor_parallel/layers.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from train_workers.megatron.config import MegatronLayout

_LAYER = "decoder.layers."
_HF_LAYER = "model.layers."
#: Megatron leaf name in a decoder layer → (HF leaf name, TP split kind). Kinds: "rep" replicated, "row" split dim 1.
_SIMPLE = {
    "input_layernorm.weight": ("input_layernorm.weight", "rep"),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", "rep"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", "row"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", "row"),
}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    """HF q/k/v projections → Megatron ``linear_qkv`` (all query groups, before the TP split).

    Args:
        q: [nq·d, H] weight or [nq·d] bias; k, v: [G·d, H] or [G·d]; one dtype.
    Returns:
        [(nq + 2G)·d, H] (or [(nq + 2G)·d]), rows ordered per query group as [q heads of the group, k, v].
    Raises:
        ValueError: a shape does not match ``layout``.
    """
    g, d, hpg = layout.num_query_groups, layout.head_dim, layout.heads_per_group
    if q.shape[0] != g * hpg * d or k.shape[0] != g * d or v.shape[0] != g * d:
        raise ValueError(f"expected q, k, v rows ({g * hpg * d}, {g * d}, {g * d}), got "
                         f"({q.shape[0]}, {k.shape[0]}, {v.shape[0]})")
    rest = q.shape[1:]
    return torch.cat([q.reshape(g, hpg * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)],
                     dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, layout: MegatronLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: [(nq + 2G)·d, ...] → (q [nq·d, ...], k [G·d, ...], v [G·d, ...]), contiguous."""
    g, d, hpg = layout.num_query_groups, layout.head_dim, layout.heads_per_group
    if qkv.shape[0] != g * (hpg + 2) * d:
        raise ValueError(f"expected {g * (hpg + 2) * d} linear_qkv rows, got {qkv.shape[0]}")
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (hpg + 2) * d, *rest).split([hpg * d, d, d], dim=1)
    return q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous()


def pad_vocab(weight: torch.Tensor, layout: MegatronLayout) -> torch.Tensor:
    """[V, H] → [Vp, H]: zero rows appended up to ``layout.padded_vocab_size`` (same dtype)."""
    if weight.shape[0] != layout.vocab_size:
        raise ValueError(f"expected {layout.vocab_size} vocabulary rows, got {weight.shape[0]}")
    pad = weight.new_zeros(layout.padded_vocab_size - layout.vocab_size, *weight.shape[1:])
    return torch.cat([weight, pad])


def shard_fc1(gate: torch.Tensor, up: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """HF gate/up [F, H] → TP rank ``tp_rank``'s ``linear_fc1`` [2F/tp, H] = [gate chunk; up chunk]."""
    return torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])


def unshard_fc1(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`shard_fc1` over all TP ranks (in rank order): → (gate [F, H], up [F, H])."""
    halves = [s.chunk(2) for s in shards]
    return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])


def _tp_chunk(t: torch.Tensor, kind: str, tp: int, tp_rank: int) -> torch.Tensor:
    if kind == "rep":
        return t
    return t.chunk(tp, dim=0 if kind == "col" else 1)[tp_rank]


def _tp_cat(shards: list[torch.Tensor], kind: str) -> torch.Tensor:
    if kind == "rep":
        return shards[0]
    return torch.cat(shards, dim=0 if kind == "col" else 1)


def hf_to_megatron(hf: Mapping[str, torch.Tensor], layout: MegatronLayout, tp_rank: int = 0,
                   pp_rank: int = 0) -> dict[str, torch.Tensor]:
    """The state dict (parameters only, no ``_extra_state``) of Megatron rank (``tp_rank``, ``pp_rank``)'s
    ``GPTModel`` from a full HF state dict, each tensor a fresh contiguous copy in its HF dtype.

    Args:
        hf: HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` state dict (full tensors, any one dtype); ``lm_head.weight``
            is ignored when ``layout.tied_embeddings``.
    Raises:
        KeyError: an HF tensor the layout needs is missing.
        ValueError: a rank is out of range or a shape does not match ``layout``.
    """
    tp = layout.tp
    if not 0 <= tp_rank < tp:
        raise ValueError(f"expected tp_rank in [0, {tp}), got {tp_rank}")
    layers = layout.stage_layers(pp_rank)
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    out: dict[str, torch.Tensor] = {}
    if first:
        out["embedding.word_embeddings.weight"] = pad_vocab(hf["model.embed_tokens.weight"], layout).chunk(tp)[tp_rank]
    for local, i in enumerate(layers):
        src, dst = f"{_HF_LAYER}{i}.", f"{_LAYER}{local}."
        for meg, (name, kind) in _SIMPLE.items():
            out[dst + meg] = _tp_chunk(hf[src + name], kind, tp, tp_rank)
        attn = src + "self_attn."
        suffixes = ("weight", "bias") if layout.qkv_bias else ("weight",)
        for suffix in suffixes:
            qkv = fuse_qkv(*(hf[f"{attn}{p}_proj.{suffix}"] for p in "qkv"), layout)
            out[f"{dst}self_attention.linear_qkv.{suffix}"] = qkv.chunk(tp)[tp_rank]
        out[dst + "mlp.linear_fc1.weight"] = shard_fc1(hf[src + "mlp.gate_proj.weight"],
                                                       hf[src + "mlp.up_proj.weight"], tp, tp_rank)
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        head = "model.embed_tokens.weight" if layout.tied_embeddings else "lm_head.weight"
        if not (layout.tied_embeddings and first):
            out["output_layer.weight"] = pad_vocab(hf[head], layout).chunk(tp)[tp_rank]
    return {k: v.contiguous().clone() for k, v in out.items()}


def megatron_param_to_hf(name: str, shards: list[torch.Tensor],
                         layout: MegatronLayout) -> list[tuple[str, torch.Tensor]]:
    """One Megatron parameter, gathered over its TP ranks, in HF names and shapes (vocabulary padding removed).

    Args:
        name: the Megatron name with the *global* layer index (``decoder.layers.{i}...``, i in [0, L)).
        shards: the parameter on TP ranks 0..tp-1, in rank order (a replicated one, a norm: any one or all of
            them; a split one: all tp of them).
    Returns:
        [(HF name, tensor)], one entry, or three for ``linear_qkv`` (q, k, v) and two for ``linear_fc1`` (gate, up);
        empty for ``output_layer.weight`` with tied embeddings (the embedding is the HF source of truth).
    Raises:
        KeyError: ``name`` is not a parameter of the Llama/Qwen2 layout.
        ValueError: the number of shards is neither 1 (replicated) nor tp, one shard of a TP-split parameter, or a
            shape does not match ``layout``.
    """
    if len(shards) not in (1, layout.tp):
        raise ValueError(f"{name}: expected 1 or tp={layout.tp} shards, got {len(shards)}")
    leaf = name[len(_LAYER):].split(".", 1)[-1] if name.startswith(_LAYER) else name
    replicated = leaf == "decoder.final_layernorm.weight" or _SIMPLE.get(leaf, ("", ""))[1] == "rep"  # the norms
    if not replicated and len(shards) != layout.tp:
        raise ValueError(f"{name}: split over tp={layout.tp} ranks: expected {layout.tp} shards, got {len(shards)}")
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name == "output_layer.weight" and layout.tied_embeddings:
            return []
        hf_name = "model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight"
        return [(hf_name, torch.cat(shards)[: layout.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shards[0])]
    if not name.startswith(_LAYER):
        raise KeyError(f"{name}: not a parameter of the Megatron Llama/Qwen2 layout")
    index, leaf = name[len(_LAYER):].split(".", 1)
    prefix = f"{_HF_LAYER}{index}."
    if leaf in _SIMPLE:
        hf_leaf, kind = _SIMPLE[leaf]
        return [(prefix + hf_leaf, _tp_cat(shards, kind))]
    if leaf.startswith("self_attention.linear_qkv."):
        suffix = leaf.rsplit(".", 1)[1]
        q, k, v = split_qkv(torch.cat(shards), layout)
        return [(f"{prefix}self_attn.{p}_proj.{suffix}", t) for p, t in zip("qkv", (q, k, v))]
    if leaf == "mlp.linear_fc1.weight":
        gate, up = unshard_fc1(shards)
        return [(prefix + "mlp.gate_proj.weight", gate), (prefix + "mlp.up_proj.weight", up)]
    raise KeyError(f"{name}: not a parameter of the Megatron Llama/Qwen2 layout")


def hf_stage(hf_name: str, layout: MegatronLayout) -> int:
    """The pipeline stage holding HF tensor ``hf_name``: the embedding on the first, the final norm and ``lm_head``
    on the last, layer i on ``i // layers_per_stage`` (with tied embeddings the last stage's copy is not an HF
    tensor: the first stage's embedding is the source of truth).

    Raises:
        KeyError: ``hf_name`` is not a tensor of the Llama/Qwen2 layout.
    """
    if hf_name == "model.embed_tokens.weight":
        return 0
    if hf_name in ("model.norm.weight", "lm_head.weight"):
        return layout.pp - 1
    if hf_name.startswith(_HF_LAYER):
        index = int(hf_name[len(_HF_LAYER):].split(".", 1)[0])
        if 0 <= index < layout.num_layers:
            return index // layout.layers_per_stage
    raise KeyError(f"{hf_name}: not a tensor of the HF Llama/Qwen2 layout with {layout.num_layers} layers")


def global_layer_name(name: str, layout: MegatronLayout, pp_rank: int) -> str:
    """Stage-local Megatron name → global one (``decoder.layers.{l}`` → ``decoder.layers.{l + offset}``)."""
    if not name.startswith(_LAYER):
        return name
    local, rest = name[len(_LAYER):].split(".", 1)
    return f"{_LAYER}{int(local) + layout.stage_layers(pp_rank).start}.{rest}"


def megatron_to_hf(shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
                   layout: MegatronLayout) -> dict[str, torch.Tensor]:
    """Full HF state dict from every Megatron rank's state dict.

    Args:
        shards: (pp_rank, tp_rank) → that rank's ``GPTModel.state_dict()`` (stage-local layer names;
            ``_extra_state`` entries are skipped), for every pp_rank < pp and tp_rank < tp.
    Returns:
        HF name → tensor (dtype unchanged); ``lm_head.weight`` only for untied embeddings.
    Raises:
        KeyError: a rank's state dict is missing or holds a name outside the layout.
    """
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(layout.pp):
        ranks = [shards[(pp_rank, t)] for t in range(layout.tp)]
        for name in ranks[0]:
            if name.endswith("._extra_state"):
                continue
            gname = global_layer_name(name, layout, pp_rank)
            out.update(megatron_param_to_hf(gname, [r[name] for r in ranks], layout))
    return out
