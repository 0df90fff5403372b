"""Which tensors a sync checks: all (``sync.verify: true``), none (``false``) or a rotating sample (``"sample"``).

With ``"sample"`` and K = ``sync.verify_full_every``, policy version v checks every tensor when v mod K = 0 and
otherwise the tensors whose plan index i has i mod K = v mod K: a deterministic subset of about 1/K of the tensors
that rotates, so K consecutive versions check every tensor at least once, and every K-th version checks them all.
Sender and receivers are given the same names, so both checksum only those; :func:`compare_checksums` then holds
each receiver's CRC-32s against the sender's.

A LoRA adapter sync is checked once more, for what checksums cannot see: the bytes may arrive intact and still bind
to nothing (an engine whose LoRA module names differ from the adapter's serves the base model without an error).
:func:`check_adapter_binding` holds the modules each engine worker reports bound against the trainer's targets
(:func:`adapter_targets`); :class:`AdapterSyncError` is also what the loop raises for a frozen adapter.
"""

from __future__ import annotations

from collections.abc import Sequence


def checked_names(names: Sequence[str], policy_version: int, verify: bool | str, full_every: int) -> list[str]:
    """The tensor names to checksum at ``policy_version``, in plan order (empty: no check).

    Raises:
        ValueError: ``verify`` is not True/False/"sample", or ``full_every`` < 1.
    """
    if verify is True:
        return list(names)
    if verify is False:
        return []
    if verify != "sample":
        raise ValueError(f"sync.verify must be true, false or 'sample', got {verify!r}")
    if full_every < 1:
        raise ValueError(f"sync.verify_full_every must be >= 1, got {full_every}")
    phase = policy_version % full_every
    if phase == 0:
        return list(names)
    return [n for i, n in enumerate(names) if i % full_every == phase]


class SyncVerificationError(RuntimeError):
    """An engine's received weights differ from what the trainer sent."""


def compare_checksums(sent: dict[str, int], got: dict[str, int], who: str) -> None:
    """Check one receiver's CRC-32 checksums (tensor name → crc of the bytes received) against the sender's.

    Args:
        sent: the sender's checksums of the checked tensors. got: the receiver's, for the same names.
        who: names the receiver in the error, e.g. ``"engine 1 worker 0"``.

    Raises:
        SyncVerificationError: the tensor sets differ (naming up to five missing and extra names), or a tensor's
            checksum differs (naming the first such tensor and both checksums).
    """
    if set(sent) != set(got):
        missing, extra = sorted(set(sent) - set(got)), sorted(set(got) - set(sent))
        raise SyncVerificationError(f"{who}: received tensor set differs: missing {missing[:5]}, extra {extra[:5]}")
    for name, crc in sent.items():
        if got[name] != crc:
            raise SyncVerificationError(
                f"{who}: tensor {name} checksum mismatch: trainer crc32 {crc:#010x}, engine crc32 {got[name]:#010x}")


class AdapterSyncError(SyncVerificationError):
    """A LoRA adapter sync that would leave the engines sampling another policy than the trainer's: the adapter
    bound to no module, or to other modules than the trainer targets, or its payload did not change after an
    update (a frozen adapter). Not retried: the same sync would fail the same way."""


#: The suffixes of PEFT's saved adapter tensor names (``<prefix><module>.lora_A.weight``).
_ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_PEFT_PREFIX = "base_model.model."


def adapter_targets(names: Sequence[str]) -> list[str]:
    """The modules a LoRA adapter payload targets, from its tensors' PEFT saved names
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` → ``model.layers.0.self_attn.q_proj``),
    sorted, each once; names that are not adapter tensors are ignored."""
    out = set()
    for name in names:
        for suffix in _ADAPTER_SUFFIXES:
            if name.endswith(suffix):
                out.add(name[:-len(suffix)].removeprefix(_PEFT_PREFIX))
    return sorted(out)


def check_adapter_binding(targeted: Sequence[str], bound: Sequence[str] | None, who: str) -> None:
    """Check that an engine worker's served adapter is bound to as many modules as the trainer targets.

    Args:
        targeted: the trainer's targeted modules (:func:`adapter_targets` of the streamed names).
        bound: the modules the engine worker reports bound after the sync (``ReceiveReport.worker_adapter_modules``
            entry); None: it reported nothing.
        who: names the worker in the error, e.g. ``"engine 0 worker 0"``.

    Raises:
        AdapterSyncError: nothing reported, zero modules bound, or a count different from ``len(targeted)``; the
            message names up to five targeted modules left unbound (or, with the count right but names that differ,
            extra ones).
    """
    if bound is None:
        raise AdapterSyncError(f"{who}: reported no adapter binding after an adapter sync (expected the "
                               f"{len(targeted)} targeted modules)")
    missing = sorted(set(targeted) - set(bound))
    extra = sorted(set(bound) - set(targeted))
    if bound and len(set(bound)) == len(set(targeted)):
        return
    samples = "the base model" if not bound else "another policy than the trainer's"
    more = " ..." if len(missing) > 5 else ""
    raise AdapterSyncError(
        f"{who}: the LoRA adapter is bound to {len(set(bound))} module(s), the trainer targets {len(targeted)}: "
        f"unbound {missing[:5]}{more}, bound but not targeted {extra[:5]}; the engine would sample {samples} "
        f"(compare train.lora.target_modules with the engine's LoRA modules, or use train.lora.sync: merged)")
