"""The policy-version ledger (``contract.versions``): the trainer's version advances by one per applied update
and never goes back; engines keep their version across a rebuilt group, are unknown when new or after a failed sync,
and are stale until a sync brings them to the trainer's version."""

from __future__ import annotations

import pytest

from contract.versions import PolicyVersionError, PolicyVersionLedger


def test_trained_advances_by_one_and_skipped_steps_do_not():
    ledger = PolicyVersionLedger()
    assert ledger.current == 0
    assert ledger.trained(1) is True and ledger.current == 1
    assert ledger.trained(1) is False and ledger.current == 1  # every update skipped: same version
    assert ledger.trained(2) is True and ledger.current == 2


def test_trained_backwards_or_jumping_raises():
    ledger = PolicyVersionLedger(5)  # resumed from a checkpoint at version 5
    with pytest.raises(PolicyVersionError, match=r"reported policy version 4 after a train step at version 5; "
                                                 r"expected 5 \(skipped\) or 6"):
        ledger.trained(4)
    with pytest.raises(PolicyVersionError, match=r"reported policy version 7"):
        ledger.trained(7)
    assert ledger.current == 5
    with pytest.raises(PolicyVersionError, match=">= 0"):
        PolicyVersionLedger(-1)


def test_current_is_read_only():
    ledger = PolicyVersionLedger(2)
    with pytest.raises(AttributeError):
        ledger.current = 3


def test_stale_engines_through_rebuild_sync_and_failure():
    a, b, c = object(), object(), object()
    ledger = PolicyVersionLedger()
    ledger.set_engines([a, b])
    assert ledger.engine_versions == [None, None] and ledger.stale_engines() == [0, 1]  # new: unknown
    ledger.synced(0, [0, 0])
    assert ledger.engine_versions == [0, 0] and ledger.stale_engines() == []

    ledger.trained(1)
    assert ledger.stale_engines() == [0, 1]  # the trainer moved on
    ledger.synced(1, [1, 1])
    ledger.set_engines([c, b])  # a replaced by c: b keeps its version
    assert ledger.engine_versions == [None, 1] and ledger.stale_engines() == [0]

    ledger.sync_failed()  # a partial load anywhere: every engine unknown
    assert ledger.engine_versions == [None, None] and ledger.stale_engines() == [0, 1]


def test_synced_reports_are_checked():
    ledger = PolicyVersionLedger(1)
    ledger.set_engines([object(), object()])
    with pytest.raises(PolicyVersionError, match="synced policy version 0, but the trainer is at 1"):
        ledger.synced(0, [0, 0])
    with pytest.raises(PolicyVersionError, match=r"engine 1 reports 0"):
        ledger.synced(1, [1, 0])
    with pytest.raises(PolicyVersionError, match=r"1 engine report\(s\) for a group of 2"):
        ledger.synced(1, [1])
    assert ledger.stale_engines() == [0, 1]


def test_engine_reports_and_staleness():
    ledger = PolicyVersionLedger(3)
    assert ledger.staleness(3) == 0 and ledger.staleness(1) == 2
    ledger.check_engine(3, "engine 0")
    ledger.check_engine(None, "engine 0")  # after a failed sync: unknown, not wrong
    with pytest.raises(PolicyVersionError, match="engine 2 reports policy version 4, ahead of the trainer's 3"):
        ledger.check_engine(4, "engine 2")
    with pytest.raises(PolicyVersionError, match="a sampled group reports policy version 5"):
        ledger.staleness(5)
    ledger.check_trainer(3)
    with pytest.raises(PolicyVersionError, match="trainer is at policy version 2, expected 3"):
        ledger.check_trainer(2)
