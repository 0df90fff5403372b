"""Hugging Face Llama-family ``config.json`` → Megatron-core ``TransformerConfig`` and ``GPTModel`` arguments.

Supported: ``LlamaForCausalLM`` (SmolLM2, Llama 2/3 without rope scaling) and ``Qwen2ForCausalLM`` (Qwen2.5) shapes,
i.e. RMSNorm, SwiGLU MLP, RoPE (``rope_theta``, non-interleaved "rotate half" halves, the HF convention),
grouped-query attention, tied or untied input/output embeddings, and q/k/v biases (Qwen2). Anything else is refused
with :class:`MegatronLayoutError` naming the config key, before any weight is read.

The layout rules (:func:`check_megatron_layout`) are pure Python on the ``config.json`` dict and import no megatron;
:func:`transformer_config` and :func:`gpt_model_kwargs` import megatron-core lazily.

Layout facts and where they come from (megatron-core 0.16.1):
- TP splits attention by query group: ``divide(num_query_groups, tp)`` and ``divide(num_attention_heads, tp)`` in
  ``megatron/core/transformer/attention.py`` (``Attention.__init__``), so heads and kv heads must divide by TP.
- PP splits the decoder layers evenly: ``get_num_layers_to_build`` / ``get_transformer_layer_offset`` in
  ``megatron/core/transformer/transformer_block.py`` (without uneven first/last-stage settings), so layers % PP == 0.
- The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by × TP`` (Megatron-LM's
  ``_vocab_size_with_padding`` in ``megatron/training/tokenizer/tokenizer.py``; Megatron-Bridge does the same in
  ``calculate_padded_vocab_size``): the vocabulary itself never has to divide by TP.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: ``config.json`` ``architectures`` entries this backend builds.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
#: Megatron-LM's default ``--make-vocab-size-divisible-by``.
VOCAB_DIVISIBLE_BY = 128


class MegatronLayoutError(ValueError):
    """A model/parallel layout the Megatron backend cannot build; ``field`` names the spec field or config key."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class MegatronLayout:
    """A Llama-family model's shapes and its Megatron TP×PP layout, all derived from ``config.json``.

    Sizes are counts (not bytes). ``padded_vocab_size`` = ``vocab_size`` rounded up to a multiple of
    ``vocab_divisible_by × tp``; rows ``[vocab_size, padded_vocab_size)`` of the embedding and output layer are
    padding (zeros) that :mod:`train_workers.megatron.convert` adds on the way in and drops on the way out.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tp: int = 1
    pp: int = 1

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.pp

    def stage_layers(self, pp_rank: int) -> range:
        """Global (HF) indices of the decoder layers pipeline stage ``pp_rank`` holds; its local Megatron index of
        global layer ``i`` is ``i - stage_layers(pp_rank).start`` (even split, ``get_transformer_layer_offset``)."""
        if not 0 <= pp_rank < self.pp:
            raise ValueError(f"expected pp_rank in [0, {self.pp}), got {pp_rank}")
        return range(pp_rank * self.layers_per_stage, (pp_rank + 1) * self.layers_per_stage)


def read_hf_config(model_path: str | Path) -> dict[str, Any]:
    """The model folder's ``config.json`` as a dict. Raises OSError/ValueError when missing or not JSON."""
    return json.loads((Path(model_path) / "config.json").read_text())


def _rope_theta(cfg: dict[str, Any]) -> float:
    """``rope_theta`` from the top level (transformers 4) or ``rope_parameters`` (transformers 5); refuses scaling."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or ({} if params.get("rope_type", "default") == "default" else params)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise MegatronLayoutError("rope_scaling", f"expected no RoPE scaling (plain rope_theta), got {scaling}")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def check_megatron_layout(hf_config: dict[str, Any], tp: int = 1, pp: int = 1,
                          vocab_divisible_by: int = VOCAB_DIVISIBLE_BY) -> MegatronLayout:
    """Check that the model in ``hf_config`` (a ``config.json`` dict) can be built by Megatron-core with tensor
    parallel size ``tp`` and pipeline parallel size ``pp``, and return its :class:`MegatronLayout`.

    Rules: a supported architecture (:data:`SUPPORTED_ARCHITECTURES`) with ``hidden_act`` silu, no MLP/output bias,
    no sliding window and no RoPE scaling; ``num_attention_heads`` and ``num_key_value_heads`` divisible by ``tp``;
    ``num_hidden_layers`` divisible by ``pp``. The vocabulary is padded, so it need not divide by ``tp``.

    Raises:
        MegatronLayoutError: ``field`` is ``train.tensor_parallel_size`` / ``train.pipeline_parallel_size`` for a
            size that does not divide the model, else the offending ``config.json`` key; the message gives the
            expected and actual values.
    """
    archs = hf_config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise MegatronLayoutError("architectures", f"expected one of {list(SUPPORTED_ARCHITECTURES)}, got {archs}")
    for name, size in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if size < 1:
            raise MegatronLayoutError(f"train.{name}", f"expected {name} >= 1, got {size}")
    qwen2 = "Qwen2ForCausalLM" in archs
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise MegatronLayoutError("hidden_act", f"expected 'silu' (SwiGLU), got {act!r}")
    if hf_config.get("mlp_bias"):
        raise MegatronLayoutError("mlp_bias", "expected false: the MLP is built without biases")
    if not qwen2 and hf_config.get("attention_bias"):
        raise MegatronLayoutError("attention_bias", "expected false for Llama (it adds an o_proj bias too)")
    if hf_config.get("use_sliding_window"):
        raise MegatronLayoutError("use_sliding_window", "expected false: sliding-window attention is not built")
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    hidden = hf_config["hidden_size"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    layers = hf_config["num_hidden_layers"]
    if heads % kv_heads:
        raise MegatronLayoutError("num_key_value_heads", f"expected a divisor of num_attention_heads={heads}, "
                                                         f"got {kv_heads}")
    for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count % tp:
            raise MegatronLayoutError("train.tensor_parallel_size", (
                f"tensor_parallel_size={tp} must divide the model's {name}={count} (Megatron splits attention "
                f"by query group)"))
    if layers % pp:
        raise MegatronLayoutError("train.pipeline_parallel_size", (
            f"pipeline_parallel_size={pp} must divide the model's num_hidden_layers={layers}"))
    vocab = hf_config["vocab_size"]
    multiple = vocab_divisible_by * tp
    return MegatronLayout(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=kv_heads,
        head_dim=head_dim, ffn_hidden_size=hf_config["intermediate_size"], vocab_size=vocab,
        padded_vocab_size=math.ceil(vocab / multiple) * multiple,
        tied_embeddings=bool(hf_config.get("tie_word_embeddings", False)), qkv_bias=qwen2,
        rope_theta=_rope_theta(hf_config), rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=hf_config.get("max_position_embeddings", 4096), tp=tp, pp=pp)


def transformer_config(layout: MegatronLayout, params_dtype=None, use_cpu_initialization: bool = True,
                       sequence_parallel: bool = False, compute_dtype=None):
    """Megatron-core ``TransformerConfig`` of ``layout`` (no dropout, no fused kernels: the same math on CPU and GPU).

    ``calculate_per_token_loss=True``: the GRPO loss a pipeline's last stage returns per micro-batch is already its
    share of the globally normalised batch loss (``train_workers.grpo_step``), so megatron-core's schedule must not
    divide it by the token or micro-batch count (``forward_step_calc_loss`` in ``pipeline_parallel/schedules.py``).

    Args:
        params_dtype: torch dtype of the parameters; None is float32.
        use_cpu_initialization: build parameters on CPU (required without CUDA).
        compute_dtype: torch dtype the forward and backward run in (None: ``params_dtype``). bfloat16/float16 set
            ``bf16``/``fp16`` (in the local layer spec that only makes attention's softmax run in float32,
            ``DotProductAttention``'s ``FusedScaleMaskSoftmax(input_in_bf16=config.bf16)``) and ``pipeline_dtype``
            (the dtype of activations sent between pipeline stages); the parameters stay ``params_dtype``
            (mixed precision: ``train_workers.megatron.shard`` module docstring).
        sequence_parallel: ``train.sequence_parallel`` (needs ``layout.tp`` > 1): the activations outside attention
            and MLP are split by sequence over the TP ranks ([S/tp, B, H]); the norm weights get
            ``sequence_parallel=True`` (:class:`SequenceParallelRMSNorm`) and their gradients must be summed over
            the TP group before the optimizer (``engine.MegatronEngine.clip_gradients``).
    """
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = params_dtype or torch.float32
    compute = compute_dtype or dtype
    return TransformerConfig(
        num_layers=layout.num_layers, hidden_size=layout.hidden_size, num_attention_heads=layout.num_attention_heads,
        num_query_groups=layout.num_query_groups, kv_channels=layout.head_dim, ffn_hidden_size=layout.ffn_hidden_size,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp, pipeline_dtype=compute,
        sequence_parallel=sequence_parallel, normalization="RMSNorm", layernorm_epsilon=layout.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=layout.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, bf16=compute == torch.bfloat16,
        fp16=compute == torch.float16, use_cpu_initialization=use_cpu_initialization, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, calculate_per_token_loss=True)


def gpt_model_kwargs(layout: MegatronLayout, config, pre_process: bool = True, post_process: bool = True,
                     parallel_output: bool = True) -> dict[str, Any]:
    """Keyword arguments of ``megatron.core.models.gpt.GPTModel`` for ``layout`` with the local (non-Transformer-
    Engine) layer spec ``get_gpt_layer_local_spec(normalization="RMSNorm")``, which runs without CUDA, its norms
    (two per layer and the final one, a ``TransformerBlockSubmodules`` of ``layout.layers_per_stage`` layers, the
    even split ``get_num_layers_to_build`` makes) built as :class:`SequenceParallelRMSNorm`.

    ``pre_process``/``post_process``: this pipeline stage holds the embedding / the final norm and output layer.
    ``parallel_output``: True leaves logits split by vocabulary over the TP ranks ([B, T, V_padded / tp]).
    """
    from dataclasses import replace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    layer.submodules = replace(layer.submodules, input_layernorm=SequenceParallelRMSNorm,
                               pre_mlp_layernorm=SequenceParallelRMSNorm)
    block = TransformerBlockSubmodules(layer_specs=[layer] * layout.layers_per_stage,
                                       layer_norm=SequenceParallelRMSNorm)
    return dict(config=config, transformer_layer_spec=block,
                vocab_size=layout.padded_vocab_size, max_sequence_length=layout.max_position_embeddings,
                pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
                share_embeddings_and_output_weights=layout.tied_embeddings, position_embedding_type="rope",
                rotary_percent=1.0, rotary_base=layout.rope_theta)


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm(hidden_size, eps)`` built from megatron-core's norm arguments ``(config, hidden_size, eps,
    ...)``, with ``weight.sequence_parallel = config.sequence_parallel``.

    megatron-core's local spec builds RMSNorm as ``WrappedTorchNorm`` when apex is absent (here), which asserts
    ``not config.sequence_parallel`` (``megatron/core/transformer/torch_norm.py``) because it leaves the weight
    unmarked; apex's ``FusedLayerNorm`` and TE's norms mark it, and megatron's ``finalize_model_grads``
    (``_allreduce_layernorm_grads``) all-reduces the marked gradients over the TP group. The forward is the same
    per-token math on a sequence shard [S/tp, B, H] as on the whole sequence. Same parameter (``weight`` [H],
    float32 until a ``Float16Module`` casts it) as ``WrappedTorchNorm``, so checkpoints and the HF conversion are
    unchanged.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)
