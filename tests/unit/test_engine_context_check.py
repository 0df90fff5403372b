"""``cluster.data.model_checks.check_engine_context``: an engine context past the model's positions is refused before
any engine starts (the Ray fleet's ``check``), naming the spec field it comes from and the model's ``config.json``
key (vLLM would refuse it inside the engine actor, a traceback; issue 36: an agent spec's default
``rollout.agent_pool.max_episode_tokens`` = 4096 on a 2048-position model)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from cluster.data.model_checks import check_engine_context, model_context
from cluster.data.models import ModelError


def _config_dir(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return str(tmp_path)


def _spec(max_model_len=None, agent=None, max_episode_tokens=4096, max_prompt_tokens=256, max_response_tokens=64):
    rollout = SimpleNamespace(max_model_len=max_model_len, agent=agent, multi_turn=None,
                              max_response_tokens=max_response_tokens,
                              agent_pool=SimpleNamespace(max_episode_tokens=max_episode_tokens))
    return SimpleNamespace(rollout=rollout, data=SimpleNamespace(max_prompt_tokens=max_prompt_tokens))


def test_agent_engine_context_past_the_models_positions_is_refused_naming_the_field(tmp_path):
    model = _config_dir(tmp_path, max_position_embeddings=2048)
    with pytest.raises(ModelError, match=r"^rollout\.agent_pool\.max_episode_tokens .*: expected an engine context "
                                         r"of at most the model's max_position_embeddings = 2048 tokens .*got 4096$"):
        check_engine_context(_spec(agent="agent.py:run"), model)
    check_engine_context(_spec(agent="agent.py:run", max_episode_tokens=2048), model)


@pytest.mark.parametrize(("spec", "field"), [
    (_spec(max_model_len=4096), "rollout.max_model_len"),
    (_spec(max_prompt_tokens=2000, max_response_tokens=100), "data.max_prompt_tokens + rollout.max_response_tokens"),
])
def test_engine_context_past_the_models_positions_is_refused_for_every_source(tmp_path, spec, field):
    model = _config_dir(tmp_path, n_positions=2048, max_position_embeddings=4096)  # the smaller key binds
    with pytest.raises(ModelError, match="^" + re.escape(field) + r": .* n_positions = 2048 tokens"):
        check_engine_context(spec, model)


def test_engine_context_is_not_judged_with_rope_scaling_or_without_a_positions_key(tmp_path):
    assert model_context(SimpleNamespace(max_position_embeddings=2048, rope_scaling={"factor": 4.0})) is None
    per_layer_type = {"full_attention": {"rope_type": "default"},
                      "sliding_attention": {"rope_type": "linear", "factor": 8.0}}
    assert model_context(SimpleNamespace(max_position_embeddings=2048, rope_parameters=per_layer_type)) is None
    plain = SimpleNamespace(max_position_embeddings=2048, rope_parameters={"rope_theta": 1e4, "rope_type": "default"})
    assert model_context(plain) == ("max_position_embeddings", 2048)
    assert model_context(SimpleNamespace()) is None
    check_engine_context(_spec(max_model_len=8192), _config_dir(tmp_path, max_position_embeddings=2048,
                                                                 rope_scaling={"type": "linear", "factor": 4.0}))


def test_agent_spec_past_the_models_positions_is_refused_by_the_ray_fleets_check(tmp_path):
    from cluster.ray_shell.fleet import EngineFleet

    spec = _spec(agent="agent.py:run")
    spec.model = SimpleNamespace(revision=None, trust_remote_code=False)
    with pytest.raises(ModelError, match=r"^rollout\.agent_pool\.max_episode_tokens .* got 4096$"):
        EngineFleet(spec).check(_config_dir(tmp_path, max_position_embeddings=2048))
