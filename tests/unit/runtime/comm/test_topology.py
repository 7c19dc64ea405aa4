"""The one default rule for ranks per node (``topology.ranks_per_node``), used by the engine hook."""
import pytest

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.runtime.comm.topology import ranks_per_node
from deepspeed_loco.runtime.zero import deepspeed_seam, stage3_hook


@pytest.mark.parametrize("configured, environ, devices, expected", [
    (2, {"LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "8"}, 8, 2),  # the config wins over everything
    (None, {"LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "8"}, 8, 4),  # then LOCAL_WORLD_SIZE
    (None, {"LOCAL_WORLD_SIZE": "", "LOCAL_SIZE": "8"}, 2, 8),  # an empty variable counts as unset
    (None, {}, 8, 8),  # then the accelerator count
    (None, {}, 16, 8),  # capped at the world size
    (None, {}, 0, 1),  # no accelerator: one rank per node
])
def test_ranks_per_node_precedence(configured, environ, devices, expected):
    assert ranks_per_node(configured, 8, devices, environ) == expected


def test_engine_hook_uses_the_same_rule(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "2")
    monkeypatch.setattr(deepspeed_seam, "local_device_count", lambda: 8)
    assert stage3_hook.resolve_local_size(LocoConfig(), 8) == 2
    monkeypatch.delenv("LOCAL_SIZE")
    assert stage3_hook.resolve_local_size(LocoConfig(), 4) == 4
    assert stage3_hook.resolve_local_size(LocoConfig(local_world_size=1), 4) == 1
