"""Which tensors a sync checks: all (``sync.verify: true``), none (``false``) or a rotating sample (``"sample"``).

With ``"sample"`` and K = ``sync.verify_full_every``, policy version v checks every tensor when v mod K = 0 and
otherwise the tensors whose plan index i has i mod K = v mod K: a deterministic subset of about 1/K of the tensors
that rotates, so K consecutive versions check every tensor at least once, and every K-th version checks them all.
Sender and receivers are given the same names, so both checksum only those; :func:`compare_checksums` then holds
each receiver's CRC-32s against the sender's.
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
