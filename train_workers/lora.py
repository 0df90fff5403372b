"""LoRA adapters on a train rank's policy (PEFT): which layers get them, wrapping before FSDP2 sharding, the reference
policy as the same module with the adapters off, and the merged weights the engines receive.

LoRA (Hu et al. 2021, arXiv:2106.09685): a targeted ``nn.Linear`` ``y = W x`` becomes ``y = W x + s · B (A x)`` with
``A`` [r, in_features] and ``B`` [out_features, r] float32, ``s = alpha / r`` (PEFT's ``scaling``); ``W`` is frozen.
With ``B = 0`` at initialisation the policy at step 0 is the base model.

Composition with FSDP2 (verl's order in ``fsdp_workers``: ``get_peft_model``, then FSDP; its LoRA reference log-probs
run the actor inside ``disable_adapter()``, as here): PEFT first replaces each targeted ``nn.Linear`` by a
``lora.Linear`` holding ``base_layer`` (frozen) and ``lora_A``/``lora_B`` (trainable), and marks only the adapters
``requires_grad``; then ``fully_shard`` shards each decoder layer and the root as for full fine-tuning.
FSDP2 keeps frozen and trainable parameters in one group: it all-gathers both, but reduce-scatters only gradients that
exist, i.e. the adapters' (``_fsdp_param_group.post_backward``), and AdamW holds state for the adapters only.

Names: PEFT's parameters are ``base_model.model.<HF name>`` with ``<layer>.base_layer.weight`` for a wrapped layer's
frozen weight and ``<layer>.lora_{A,B}.default.weight`` for its adapters; :func:`hf_name` maps back to the HF names
the engines and ``transformers`` use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import math
from contextlib import contextmanager

import torch
from torch import nn

from train_workers.sharding import full_tensor

#: PEFT's adapter name (one adapter per policy).
ADAPTER = "default"
#: The prefix PEFT gives the wrapped model's names (``base_model.model.<HF name>``).
PEFT_PREFIX = "base_model.model."
_ADAPTER_PARTS = (f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}.")


class LoraTargetError(ValueError):
    """``train.lora`` does not fit the model; ``field`` is the dotted spec field the message is about."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def linear_layers(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{module name: (in_features, out_features)}`` of every ``nn.Linear`` of an HF causal LM except its output
    head (which ``ResponseLogprobModel`` applies through ``head.weight`` directly, so an adapter there would never
    run). Works on a meta-device model (no weights needed)."""
    head = model.get_output_embeddings()
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not head}


def targeted_layers(lora, model: nn.Module) -> dict[str, tuple[int, int]]:
    """The linear layers ``lora.target_modules`` selects, as PEFT selects them: every one for ``all-linear``, else
    those whose name equals a given name or ends with ``"." + name``.

    Raises:
        LoraTargetError: a name matches no linear layer (``train.lora.target_modules``, listing the layer names the
            model has), or it matches the output head; ``lora.rank`` exceeds a targeted layer's smaller dimension
            (``train.lora.rank``, naming the layer).
    """
    layers = linear_layers(model)
    head_names = {n for n, m in model.named_modules() if m is model.get_output_embeddings()}
    if lora.target_modules == "all-linear":
        chosen = dict(layers)
    else:
        chosen = {}
        for key in lora.target_modules:
            hits = {n: d for n, d in layers.items() if n == key or n.endswith("." + key)}
            if any(n == key or n.endswith("." + key) for n in head_names):
                raise LoraTargetError("train.lora.target_modules", (
                    f"{key!r} is the output head, which cannot carry an adapter (the logprob head reads its weight "
                    f"directly); expected names of the decoder's linear layers: {_short_names(layers)}"))
            if not hits:
                raise LoraTargetError("train.lora.target_modules", (
                    f"{key!r} matches no linear layer of the model; it has {_short_names(layers)} (or 'all-linear')"))
            chosen.update(hits)
    if not chosen:
        raise LoraTargetError("train.lora.target_modules", "the model has no linear layer besides its output head")
    name, dims = min(chosen.items(), key=lambda kv: min(kv[1]))
    if lora.rank > min(dims):
        raise LoraTargetError("train.lora.rank", (
            f"expected rank <= {min(dims)}, the smaller dimension of targeted layer {name} (in {dims[0]}, out "
            f"{dims[1]}), got {lora.rank}"))
    return chosen


def _short_names(layers: dict) -> str:
    """The distinct last components of ``layers``' names, sorted: ``down_proj, gate_proj, k_proj, ...``."""
    return ", ".join(sorted({n.rsplit(".", 1)[-1] for n in layers}))


def lora_config(lora, model: nn.Module):
    """PEFT's ``LoraConfig`` for the spec's ``train.lora`` on ``model``, after checking it fits
    (:func:`targeted_layers`). No bias is trained (``bias="none"``), so switching the adapters off gives exactly the
    base model; ``target_modules`` is passed as the spec gives it, so ``adapter_config.json`` reads as written."""
    from peft import LoraConfig

    targeted_layers(lora, model)
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha if lora.alpha is not None else lora.rank,
                      lora_dropout=lora.dropout, target_modules=targets, bias="none", task_type="CAUSAL_LM",
                      init_lora_weights=True if lora.init == "standard" else "gaussian")


def add_adapters(hf: nn.Module, lora) -> nn.Module:
    """Wrap the HF causal LM ``hf`` with LoRA adapters (``peft.get_peft_model``; unsharded, before FSDP2): only the
    adapters require grad. Returns the ``PeftModelForCausalLM``.

    Raises:
        LoraTargetError: see :func:`targeted_layers`.
        RuntimeError: PEFT chose other layers than :func:`targeted_layers` (the merged sync relies on both agreeing).
    """
    from peft import get_peft_model

    expected = set(targeted_layers(lora, hf))
    peft_model = get_peft_model(hf, lora_config(lora, hf))
    chosen = {hf_name(n).removesuffix(".weight") for n, _ in peft_model.named_parameters()
              if n.endswith(".base_layer.weight")}
    if chosen != expected:
        raise RuntimeError(f"PEFT wrapped {sorted(chosen ^ expected)[:4]} differently from train.lora.target_modules")
    return peft_model


def is_adapter(name: str) -> bool:
    """Whether PEFT parameter ``name`` is an adapter tensor (``lora_A``/``lora_B``)."""
    return any(part in name for part in _ADAPTER_PARTS)


def saved_name(name: str) -> str:
    """A PEFT parameter name of an adapter → its name in PEFT's saved adapter file
    (``...q_proj.lora_A.default.weight`` → ``...q_proj.lora_A.weight``, as ``get_peft_model_state_dict`` writes it)."""
    for part in _ADAPTER_PARTS:
        name = name.replace(part, part.removesuffix(f"{ADAPTER}."))
    return name


def hf_name(name: str) -> str:
    """A PEFT parameter name of a base tensor → the HF name (``base_model.model.model.layers.0.self_attn.q_proj.
    base_layer.weight`` → ``model.layers.0.self_attn.q_proj.weight``)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


class LoraPolicy:
    """The LoRA side of a sharded policy, built by the worker after ``fully_shard``.

    Args:
        peft_model: the policy's ``PeftModelForCausalLM`` (``ResponseLogprobModel.model``), sharded.
        with_reference: the job has a reference policy (``algorithm.kl_coef`` > 0): the same module, adapters off.

    Attributes:
        trainable: the adapter parameters (FSDP2's sharded ones: what AdamW updates), in module order.
        num_trainable, num_total: parameter counts (whole model, not this rank's shards).
    """

    def __init__(self, peft_model: nn.Module, with_reference: bool):
        self.peft_model, self.with_reference = peft_model, with_reference
        named = list(peft_model.named_parameters())
        self.trainable = [p for n, p in named if is_adapter(n)]
        if any(p.requires_grad for n, p in named if not is_adapter(n)) or not all(p.requires_grad
                                                                                  for p in self.trainable):
            raise RuntimeError("LoRA policy: expected exactly the adapter tensors to require grad")
        self.num_trainable = sum(p.numel() for p in self.trainable)
        self.num_total = sum(p.numel() for _, p in named)

    @contextmanager
    def adapters_off(self) -> Iterator[None]:
        """Run the policy as the base model (the reference policy) inside this context (PEFT's
        ``disable_adapter()``), keeping every adapter's sharded parameter ``requires_grad``.

        PEFT switches the adapters off by a flag its layers read in ``forward``, and as a side effect sets the
        adapters' ``requires_grad`` to False (back to True on exit) on whichever parameter objects the modules hold
        at that moment: FSDP2's sharded ones, or the unsharded ones between a forward and the end of a step. FSDP2
        reads the sharded parameters' flag when it initialises a group at its first forward (which parameters are
        trainable decides the group's reduce dtype: measured here, a bfloat16 policy whose first forward ran inside
        the context reduced its gradients in bfloat16 instead of ``train.reduce_dtype``) and copies it onto the
        unsharded ones at every all-gather. So the sharded adapters are set trainable again right after PEFT's
        switch and on exit; the forward inside runs under ``no_grad`` and needs no flag.
        """
        try:
            with self.peft_model.disable_adapter():
                self._keep_trainable()
                yield
        finally:
            self._keep_trainable()

    def _keep_trainable(self) -> None:
        for p in self.trainable:
            p.requires_grad_(True)

    def merged_sources(self, engine_dtype: torch.dtype = torch.float32, rounding: MergeRounding | None = None
                       ) -> list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
        """What the engines receive in ``merged`` sync: ``(HF name, shape, gather)`` per base tensor in module order
        (tied weights once). ``gather()`` returns the whole tensor in ``engine_dtype``: ``cast(W + s · (B @ A))``
        for a layer with an adapter (PEFT's ``get_delta_weight`` and ``merge``: ``W + (B @ A) · s``), computed in
        float32 from the float32 (master) parameters into a fresh tensor — the policy's own tensors are never
        written, so no merge/unmerge cycle can drift the base weights — and ``cast(W)`` otherwise. With
        ``rounding``, every merged tensor's rounding error is added to it (:class:`MergeRounding`). A ``gather`` is
        a collective over the train group (``full_tensor``): every rank calls them in this order. No
        ``base_layer``/``lora_*`` name appears."""
        params = dict(self.peft_model.named_parameters())
        out = []
        for name, p in params.items():
            if is_adapter(name):
                continue
            layer = name.removesuffix(".base_layer.weight") if name.endswith(".base_layer.weight") else None
            if layer is None:
                out.append((hf_name(name), tuple(p.shape),
                            lambda p=p: full_tensor(p.detach()).float().to(engine_dtype)))
                continue
            a = params[f"{layer}.lora_A.{ADAPTER}.weight"]
            b = params[f"{layer}.lora_B.{ADAPTER}.weight"]
            scaling = float(self.peft_model.get_submodule(layer).scaling[ADAPTER])
            out.append((hf_name(name), tuple(p.shape),
                        lambda p=p, a=a, b=b, s=scaling: merge_to(full_tensor(p.detach()), full_tensor(a.detach()),
                                                                  full_tensor(b.detach()), s, engine_dtype, rounding)))
        return out

    def adapter_sources(self) -> list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
        """What the engines receive in ``adapter`` sync: ``(PEFT saved name, shape, gather)`` per adapter tensor in
        module order, the names as in PEFT's ``adapter_model.safetensors``
        (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: the adapter name dropped), which vLLM's
        LoRA loader reads. ``gather()`` returns the whole float32 tensor (``lora_A`` [r, in_features], ``lora_B``
        [out_features, r]); a collective over the train group (``full_tensor``): every rank calls them in order."""
        return [(saved_name(name), tuple(p.shape), lambda p=p: full_tensor(p.detach()).float())
                for name, p in self.peft_model.named_parameters() if is_adapter(name)]

    def adapter_config(self) -> dict:
        """The policy's ``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it (a copy of the config with
        ``inference_mode`` True, written by ``LoraConfig.save_pretrained``: rank, alpha, target modules, ...); the
        engines write it next to the streamed adapter tensors in ``adapter`` sync. ``target_modules`` (a set in PEFT)
        is written sorted."""
        import copy
        import json
        import tempfile

        config = copy.deepcopy(self.peft_model.peft_config[ADAPTER])
        config.inference_mode = True
        with tempfile.TemporaryDirectory() as tmp:
            config.save_pretrained(tmp)
            with open(f"{tmp}/adapter_config.json") as f:
                saved = json.load(f)
        if isinstance(saved.get("target_modules"), list):  # PEFT keeps a set: written in hash order
            saved["target_modules"] = sorted(saved["target_modules"])
        return saved

    def metrics(self) -> dict[str, float]:
        """``actor/trainable_parameters`` (adapter elements, whole model) and ``actor/trainable_fraction`` (of all
        parameters, base included)."""
        return {"actor/trainable_parameters": float(self.num_trainable),
                "actor/trainable_fraction": self.num_trainable / max(self.num_total, 1)}


class MergeRounding:
    """The rounding a merged sync adds to the LoRA update, over the merged tensors of one sync.

    Each merged tensor sent as ``M = cast(W + Δ)``, ``Δ = s · B A`` (float32, from the float32 master ``W``), adds
    ``‖M − W − Δ‖²``, ``‖M − cast(W) − Δ‖²`` and ``‖Δ‖²`` (sums in float64). Two ratios:

    - :attr:`relative_error` = sqrt(Σ‖M − W − Δ‖² / Σ‖Δ‖²): how far the engine's merged weights are from the
      trainer's policy, in units of the update (issue 30's measure). It includes the rounding of ``W`` itself, so a
      base that is not on the engine dtype's grid (float32 weights sent as bfloat16) gives values above 1 even for a
      perfectly kept update.
    - :attr:`update_error` = sqrt(Σ‖M − cast(W) − Δ‖² / Σ‖Δ‖²): how much of the update the engine's weights lose,
      relative to the base it holds anyway (``cast(W)``, what a full or adapter sync of the base gives). In
      bfloat16 (8 significant bits) an element whose |Δ| is below half the grid spacing at |W| (≈ 2⁻⁹ |W|) is
      rounded back to ``cast(W)``: the update vanishes, the error is ≈ 1 and the engines sample a policy the
      trainer never had; with a base off the grid, elements near a rounding boundary also jump a whole grid step,
      and the error exceeds 1 (the update the engines see is mostly rounding noise). For a base on the grid (a
      bfloat16 checkpoint) the two ratios are equal.

    Attributes:
        error_sq, update_error_sq, update_sq: Σ‖M − W − Δ‖², Σ‖M − cast(W) − Δ‖², Σ‖Δ‖² (float). tensors: merged
        tensors added.
    """

    def __init__(self):
        self.error_sq = self.update_error_sq = self.update_sq = 0.0
        self.tensors = 0

    def add(self, sent: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor) -> None:
        """Add one merged tensor: ``sent`` = cast(W + Δ) (any float dtype), ``weight`` W and ``delta`` Δ float32, all
        of one shape. Residuals in float32 (differences of close values are exact)."""
        got = sent.float()
        residual = (got - weight) - delta
        kept = (got - weight.to(sent.dtype).float()) - delta
        self.error_sq += float(torch.sum(residual * residual, dtype=torch.float64))
        self.update_error_sq += float(torch.sum(kept * kept, dtype=torch.float64))
        self.update_sq += float(torch.sum(delta * delta, dtype=torch.float64))
        self.tensors += 1

    @property
    def relative_error(self) -> float | None:
        """sqrt(Σ‖M − W − Δ‖² / Σ‖Δ‖²); None while Σ‖Δ‖² is 0 (no update to measure: ``B = 0`` at the start)."""
        return math.sqrt(self.error_sq / self.update_sq) if self.update_sq > 0 else None

    @property
    def update_error(self) -> float | None:
        """sqrt(Σ‖M − cast(W) − Δ‖² / Σ‖Δ‖²); None while Σ‖Δ‖² is 0."""
        return math.sqrt(self.update_error_sq / self.update_sq) if self.update_sq > 0 else None


def merge_to(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
             dtype: torch.dtype = torch.float32, rounding: MergeRounding | None = None) -> torch.Tensor:
    """``cast(W + (B @ A) · s)`` into a fresh tensor: ``weight`` [out, in], ``a`` [r, in], ``b`` [out, r] → [out, in]
    in ``dtype``, the sum taken in float32 (from float32 master weights; a lower-precision ``weight`` is upcast). None
    of the inputs is written. ``rounding``: adds this tensor's rounding error (:class:`MergeRounding`)."""
    base = weight.float()
    delta = (b.float() @ a.float()) * scaling
    merged = (base + delta).to(dtype)
    if rounding is not None:
        rounding.add(merged, base, delta)
    return merged
