"""Test-only shims that let megatron-core 0.16.1 run on CPU (over gloo), and tiny Llama/Qwen2 models for the
Megatron tests. Never imported by the backend: the worker runs on GPUs, where none of this applies.
:class:`CPUMegatronTrainWorker` runs the shims inside a Ray actor's own process (tests/ray).

The CUDA assumptions bypassed (see ../shared/GUIDE.md, megatron-core paragraph):
1. ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``
   (``megatron/core/models/common/embeddings/rotary_pos_embedding.py``): ``torch.cuda.current_device`` returns the CPU
   device here.
2. Without an explicit mask the causal mask is built on "cuda": the tests always pass ``attention_mask``.
3. ``DotProductAttention`` enters ``get_cuda_rng_tracker().fork()`` (``megatron/core/transformer/
   dot_product_attention.py``): the tracker is Megatron's own inference tracker, whose ``fork`` is a null context
   (dropout is 0 in these models).
4. With pp > 1 and tied embeddings, ``LanguageModule.setup_embeddings_and_output_layer`` calls ``.cuda()`` on the
   last stage's copy of the embedding before an all-reduce over the embedding group: that copy-at-init is skipped
   (``_is_in_embd_group`` returns False) — the tests load the copy from the HF weights instead.
5. The pipeline schedule (``forward_backward_pipelining_without_interleaving`` in ``megatron/core/pipeline_parallel/
   schedules.py``) creates its token counter with ``torch.zeros([], dtype=torch.int, device="cuda")``: the schedules
   module sees a ``torch`` whose ``zeros`` maps ``device="cuda"`` to the CPU (everything else is torch itself).
6. With ``batch_p2p_comm`` and ``batch_p2p_sync`` (megatron's defaults) ``P2PCommunicator._communicate``
   (``megatron/core/pipeline_parallel/p2p_communication.py``) calls ``torch.cuda.synchronize()`` after the batched
   isend/irecv: a no-op here (gloo's requests are already waited on). Its receive buffers are allocated on
   ``torch.cuda.current_device()``, which shim 1 makes the CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from train_workers.megatron.worker import MegatronTrainWorker  # imports no megatron-core (that comes in lazily)

VOCAB = 1100  # not a multiple of 128: padded to 1152 at tp=1 and 1280 at tp=2
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, vocab_size=VOCAB, rope_theta=50000.0)


class _TorchWithCudaZerosOnCPU:
    """``torch`` as megatron-core's schedules module sees it under shim 5: ``zeros(..., device="cuda")`` is made on
    the CPU; every other attribute is torch's own."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def install_cpu_shims() -> None:
    """Apply shims 1 and 3–6 in this process (call before building a GPTModel)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    LanguageModule._is_in_embd_group = lambda self: False
    schedules.torch = _TorchWithCudaZerosOnCPU()


def make_tiny_hf_model(out_dir: str | Path, model_type: str, tied: bool, seed: int = 0) -> str:
    """Save a random fp32 ``model_type`` ("llama" or "qwen2") model of :data:`SHAPE` to ``out_dir``. Every tensor,
    norms and Qwen2's q/k/v biases included, is random (not HF's ones/zeros init), so a mis-mapped one shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, tie_word_embeddings=tied, **SHAPE)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out_dir)
    return str(out_dir)


def use_cpu_megatron_in_train_pool(monkeypatch) -> None:
    """Make ``TrainPool`` start :class:`CPUMegatronTrainWorker` for ``train.strategy: megatron`` until the test ends."""
    from train_workers.registry import TRAIN_BACKENDS

    monkeypatch.setitem(TRAIN_BACKENDS, "megatron", CPUMegatronTrainWorker)


class CPUMegatronTrainWorker(MegatronTrainWorker):
    """The production Megatron worker, with :func:`install_cpu_shims` run in its process before anything is built."""

    def __init__(self, *args, **kwargs):
        install_cpu_shims()
        super().__init__(*args, **kwargs)
