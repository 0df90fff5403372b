"""``grpo-cluster run --import MODULE`` reaches the train ranks: a variant a user module registers (here a loss
aggregation) is in the registry of a Ray actor after :func:`cluster.ray_shell.train_pool.import_user_modules`, which
``TrainPool`` runs on every rank before it builds. Without it the rank's registry lacks the name (the driver-only
import the spec validation sees), and a module that does not import names itself."""

from __future__ import annotations

import pytest


MODULE = '''
from grpo.losses import register_loss_aggregation


@register_loss_aggregation("user-token-sum")
def token_sum(loss, mask, **kwargs):
    return (loss * mask).sum()
'''


def test_user_modules_are_imported_on_every_rank(local_ray, tmp_path):
    from cluster.ray_shell.train_pool import import_user_modules
    from tests.faults import RegistryProbe

    (tmp_path / "user_variants.py").write_text(MODULE)
    before, after = local_ray.remote(RegistryProbe).remote(), local_ray.remote(RegistryProbe).remote()
    assert local_ray.get(before.has_loss_aggregation.remote("user-token-sum")) is False
    local_ray.get(after.__ray_call__.remote(import_user_modules, ["user_variants"], [str(tmp_path)]))
    assert local_ray.get(after.has_loss_aggregation.remote("user-token-sum")) is True
    with pytest.raises(Exception, match="--import no_such_user_module: not importable on the train rank"):
        local_ray.get(after.__ray_call__.remote(import_user_modules, ["no_such_user_module"], [str(tmp_path)]))
