"""Read and write HF safetensors folders one tensor at a time (the Megatron backend never holds a whole model).

:class:`SafetensorsFolder` is a read-only mapping over ``model.safetensors`` or the shards named by
``model.safetensors.index.json``; each lookup reads one tensor (``safetensors.safe_open``), so
``convert.hf_to_megatron`` on it reads only what a rank needs, one tensor at a time. :func:`save_hf_folder` writes
tensors produced one at a time into shards of at most ``shard_bytes`` bytes plus the index transformers and vLLM read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

INDEX = "model.safetensors.index.json"


class SafetensorsFolder(Mapping):
    """HF tensor name → tensor, read lazily from the folder ``path``.

    Raises:
        FileNotFoundError: the folder has neither ``model.safetensors`` nor ``model.safetensors.index.json``.
    """

    def __init__(self, path: str):
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        elif os.path.isfile(os.path.join(path, "model.safetensors")):
            from safetensors import safe_open

            single = os.path.join(path, "model.safetensors")
            with safe_open(single, framework="pt") as f:
                self._files = dict.fromkeys(f.keys(), single)
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors or {INDEX}")

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._files[name], framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def save_hf_folder(path: str, entries: Sequence[tuple[str, tuple[int, ...]]], tensor: Callable[[str], torch.Tensor],
                   writer: bool, shard_bytes: int = 2**30, dtype: torch.dtype = torch.float32) -> None:
    """Write tensors into ``path/model-XXXXX-of-YYYYY.safetensors`` shards + :data:`INDEX`.

    Args:
        entries: (HF name, shape) in file order. tensor: returns one named tensor (every rank calls it in
            ``entries`` order, so it may be a collective). writer: this rank writes (others only take part in
            ``tensor``). shard_bytes: most bytes of one shard unless one tensor is larger. dtype: on-disk dtype.
    """
    from safetensors.torch import save_file

    from weight_sync.buckets import plan_buckets

    shards = plan_buckets([(name, shape, dtype) for name, shape in entries], shard_bytes)
    weight_map, total = {}, 0
    if writer:
        os.makedirs(path, exist_ok=True)
    for shard in shards:
        file = f"model-{shard.index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {slot.name: tensor(slot.name).to(dtype).contiguous() for slot in shard.slots}
        if writer:
            save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
            total += shard.nbytes
        del tensors
    if writer:
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
