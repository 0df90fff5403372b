"""Every ``algorithm.*`` and ``train.*`` setting the train step reads moves the update it documents, and does not where
its documentation says it cannot: one table (:data:`KNOBS`), each row a setting, the context where it must change the
gradient the optimizer sees (or the update), and where it must not.

The real FSDP2 worker (``FSDPTrainWorker``, one gloo rank in a spawned process) trains tests/megatron_cpu.py's random
Llama on one packed batch (6 sequences, 2 micro-batches; sequence 4 repeats sequence 3 with a negative advantage) in
four contexts:

- ``moved``: policy ≠ reference policy (two random models: KL ≈ 0.4), engine (behaviour) logprobs random near the
  policy's, one iteration;
- ``iter2``: ``moved`` with two iterations at lr 1e-5 (the second one's ratios differ from 1 by about 1 %, so the
  clips act on some tokens; at lr 1e-3 the tiny model's ratios move so far that PPO's clip zeroes the whole second
  gradient);
- ``far``: ``moved`` with engine logprobs of −25 (every truncated IS weight at its cap);
- ``on``: policy = reference policy, engine logprobs = the policy's own (ratio 1, KL 0).

``train.max_grad_norm`` is 1e6 (its largest value) in every run but its own rows, so the recorded gradients are the
raw ones. "Changes": some element differs by more than 1e-3 of the baseline's largest; "does not change": no element by
more than 1e-6 of it (an update: plus two float32 roundings of the largest weight). Where the documentation gives the
effect exactly, the row checks it exactly (``check``): the entropy bonus and the KL penalty are linear in their
coefficient, TIS weights all at the cap multiply the gradient by the cap, the AdamW update is linear in ``lr``,
decoupled weight decay subtracts lr·wd·θ, ``max_grad_norm`` rescales the gradient to that norm. Settings that act before
the train step (advantages, rewards, masks, the KL controller) are audited in tests/unit/test_update_knobs_scoring.py,
which also checks that every field is audited somewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.test_fsdp_parity import ADVANTAGES, MAX_RESPONSE_TOKENS, TEMPERATURE
from tests.megatron_cpu import VOCAB, make_tiny_hf_model
from train_workers.packing import pack_microbatch
from weight_sync.group import free_ports

MICROBATCHES = [[0, 1], [2, 3, 4, 5]]
BASE_ALGORITHM = {"kl_coef": 0.0}
BASE_TRAIN = {"lr": 1e-3, "max_grad_norm": 1e6}
CONTEXTS = {
    "moved": {"policy": "policy", "behaviour": "random", "algorithm": {}},
    "iter2": {"policy": "policy", "behaviour": "random", "algorithm": {"num_iterations": 2}, "train": {"lr": 1e-5}},
    "far": {"policy": "policy", "behaviour": "far", "algorithm": {}},
    "on": {"policy": "reference", "behaviour": "own", "algorithm": {}},
}


def make_batch():
    g = torch.Generator().manual_seed(7)
    prompt_lens, response_lens = [5, 3, 8, 4, 6, 2], [4, 8, 2, 6, 3, 5]
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in response_lens]
    behaviour = [-6.0 - 2.0 * torch.rand(n, generator=g) for n in response_lens]  # near the policy's ≈ −7.0
    # sequence 4 (advantage −0.25) is sequence 3 (advantage 1.5) again: the step raises its logprobs although its
    # advantage is negative, so at the second iteration its ratio exceeds 1 with A < 0, where the dual clip acts
    prompts[4], responses[4], behaviour[4] = prompts[3], responses[3], behaviour[3].clone()
    return prompts, responses, behaviour


def microbatches(behaviour: list[torch.Tensor]):
    prompts, responses, _ = make_batch()
    return [pack_microbatch([prompts[i] for i in idx], [responses[i] for i in idx], [ADVANTAGES[i] for i in idx],
                            [behaviour[i] for i in idx], idx) for idx in MICROBATCHES]


@dataclass(frozen=True)
class Knob:
    """A row: ``setting`` (``section.field``), the overrides that set it, the context where it must change the
    ``what`` ("grad": the gradient the optimizer sees; "update": the parameters after the step), the contexts where it
    must not (with why), the baseline's own overrides (``base``), and an exact check ``(name of the check, extra
    overrides of a second run)`` where the documentation gives the effect exactly."""

    setting: str
    overrides: dict
    moves_in: str
    still_in: dict[str, str] = field(default_factory=dict)
    base: dict = field(default_factory=dict)
    what: str = "grad"
    check: tuple[str, dict] | None = None


KNOBS = [
    Knob("algorithm.entropy_coef", {"entropy_coef": 0.1}, "moved", check=("linear", {"entropy_coef": 0.2})),
    Knob("algorithm.kl_coef", {"kl_coef": 0.1}, "moved", {"on": "policy = reference: the KL and its gradient are 0"},
         check=("linear", {"kl_coef": 0.2})),
    Knob("algorithm.kl_estimator", {"kl_estimator": "k2"}, "moved", {"on": "k2 and k3 have gradient 0 at KL 0"},
         base={"kl_coef": 0.1}),
    Knob("algorithm.kl_in_reward", {"kl_in_reward": True}, "moved",
         {"on": "the KL is 0 in the reward and in the loss"}, base={"kl_coef": 0.1}),
    Knob("algorithm.policy_loss", {"policy_loss": "gspo"}, "iter2",
         {"moved": "the first iteration's ratio is 1: every mode's gradient is the policy gradient"}),
    Knob("algorithm.policy_loss", {"policy_loss": "cispo"}, "iter2", {"moved": "ratio 1 at the first iteration"},
         base={"clip_eps_low": 1e-3, "clip_eps_high": 1e-3}),  # cispo's gradient is ppo's where neither clips
    Knob("algorithm.loss_agg", {"loss_agg": "token-mean"}, "moved"),
    Knob("algorithm.loss_agg", {"loss_agg": "seq-mean-token-sum-norm"}, "moved"),
    Knob("algorithm.clip_eps_low", {"clip_eps_low": 1e-4}, "iter2", {"moved": "ratio 1 is inside any clip band"}),
    Knob("algorithm.clip_eps_high", {"clip_eps_high": 1e-4}, "iter2", {"moved": "ratio 1 is inside any clip band"}),
    Knob("algorithm.dual_clip_c", {"dual_clip_c": 1.0001, "clip_eps_low": 1e-4, "clip_eps_high": 1e-4}, "iter2",
         {"moved": "ratio 1 is below any dual-clip bound c > 1"}, base={"clip_eps_low": 1e-4, "clip_eps_high": 1e-4}),
    Knob("algorithm.num_iterations", {"num_iterations": 2}, "moved", what="update"),
    Knob("algorithm.tis_cap", {"tis_cap": 1.5}, "moved", {"on": "engine = trainer: every weight is min(1, 1.5) = 1"},
         check=("scaled_by_cap", {})),
    Knob("algorithm.tis_level", {"tis_level": "sequence"}, "moved", {"on": "ratio 1 per token and per sequence"},
         base={"tis_cap": 1.5}),
    Knob("algorithm.mis", {"mis": {"level": "token", "low": 0.5, "high": 2.0}}, "moved",
         {"on": "ratio 1 is inside the band: nothing is dropped"}),
    Knob("algorithm.mis.level", {"mis": {"level": "sequence", "low": 0.5, "high": 2.0}}, "moved",
         {"on": "ratio 1 is inside the band"}, base={"mis": {"level": "token", "low": 0.5, "high": 2.0}}),
    Knob("algorithm.mis.low", {"mis": {"level": "token", "low": 0.9, "high": 2.0}}, "moved",
         {"on": "ratio 1 is inside the band"}, base={"mis": {"level": "token", "low": 0.5, "high": 2.0}}),
    Knob("algorithm.mis.high", {"mis": {"level": "token", "low": 0.5, "high": 1.1}}, "moved",
         {"on": "ratio 1 is inside the band"}, base={"mis": {"level": "token", "low": 0.5, "high": 2.0}}),
    Knob("train.lr", {"lr": 2e-3}, "moved", what="update", check=("update_linear_in_lr", {})),
    Knob("train.weight_decay", {"weight_decay": 0.1}, "moved", what="update", check=("decoupled_decay", {})),
    Knob("train.betas", {"betas": (0.5, 0.9)}, "iter2", {"moved": "AdamW's first step is lr·sign(g) whatever the "
                                                                  "betas (bias correction)"}, what="update"),
    Knob("train.max_grad_norm", {"max_grad_norm": 1e-3}, "moved",
         {"moved": "a bound above the gradient norm clips nothing"}, check=("clipped_to_norm", {})),
]
#: The settings the rows above audit (tests/unit/test_update_knobs_scoring.py checks every field is audited).
AUDITED = sorted({k.setting for k in KNOBS})
TRAIN_FIELDS = {"lr", "weight_decay", "betas", "max_grad_norm"}


def _split(overrides: dict) -> tuple[dict, dict]:
    """(algorithm overrides, train overrides)."""
    return ({k: v for k, v in overrides.items() if k not in TRAIN_FIELDS},
            {k: v for k, v in overrides.items() if k in TRAIN_FIELDS})


def _run_key(context: str, overrides: dict) -> str:
    return f"{context}:{sorted(overrides.items())!r}"


def planned_runs() -> dict[str, tuple[str, dict]]:
    """Every distinct (context, overrides) the table needs: the baselines, the knobs set, the exact checks' runs."""
    runs = {}
    for k in KNOBS:
        still = k.still_in if k.setting != "train.max_grad_norm" else {}
        for context in [k.moves_in, *still]:
            for overrides in (k.base, {**k.base, **k.overrides}):
                runs[_run_key(context, overrides)] = (context, overrides)
        if k.setting == "train.max_grad_norm":
            runs[_run_key("moved", {"max_grad_norm": 1e5})] = ("moved", {"max_grad_norm": 1e5})
        if k.check is not None and k.check[1]:
            overrides = {**k.base, **k.check[1]}
            runs[_run_key(k.moves_in, overrides)] = (k.moves_in, overrides)
        if k.check is not None and k.check[0] == "scaled_by_cap":
            for overrides in (k.base, {**k.base, **k.overrides}):
                runs[_run_key("far", overrides)] = ("far", overrides)
    return runs


def _rank_main(rank: int, dirs: dict, runs: dict, ports: list[int], out: str) -> None:
    from cluster.spec import AlgorithmSpec, TrainSpec
    from train_workers.fsdp_worker import FSDPTrainWorker
    from train_workers.sharding import full_tensor

    torch.set_num_threads(1)
    _, responses, random_behaviour = make_batch()
    num_tokens, num_sequences = sum(len(r) for r in responses), len(responses)
    own: list[torch.Tensor] | None = None
    results = {}
    for (key, (context, overrides)), port in zip(runs.items(), ports):
        ctx = CONTEXTS[context]
        alg, tr = _split({**BASE_ALGORITHM, **BASE_TRAIN, **ctx["algorithm"], **ctx.get("train", {}), **overrides})
        algorithm = AlgorithmSpec(**{"kl_coef": 0.0, **alg})
        train = TrainSpec(world_size=1, num_threads=1, timeout_s=120, **tr)
        worker = FSDPTrainWorker(0, 1, dirs["reference"], train, algorithm, TEMPERATURE, MAX_RESPONSE_TOKENS, seed=0)
        worker.init_distributed("127.0.0.1", port, policy_path=dirs[ctx["policy"]])
        if ctx["behaviour"] == "own" and own is None:  # the policy's own logprobs, before any update
            own = [torch.zeros(0)] * len(responses)
            for idx, mb in zip(MICROBATCHES, microbatches(random_behaviour)):
                padded = worker.engine.behaviour_logprobs(mb, worker.engine.inputs(mb))
                for j, i in enumerate(idx):
                    own[i] = padded[j, :len(responses[i])].clone()
        behaviour = {"random": random_behaviour, "far": [torch.full((len(r),), -25.0) for r in responses],
                     "own": own}[ctx["behaviour"]]
        grads: dict = {}
        step = worker.optimizer.step

        def recording_step(*args, _step=step, _worker=worker, **kwargs):
            grads.clear()
            grads.update({n: full_tensor(p.grad).detach().clone()
                          for n, p in _worker.policy.model.named_parameters() if p.grad is not None})
            return _step(*args, **kwargs)

        worker.optimizer.step = recording_step
        start = {n: full_tensor(p).detach().clone() for n, p in worker.policy.model.named_parameters()}
        result = worker.train_step(microbatches(behaviour), num_tokens, num_sequences)
        end = {n: full_tensor(p).detach().clone() for n, p in worker.policy.model.named_parameters()}
        results[key] = {"metrics": result.metrics, "grad": torch.cat([grads[n].flatten() for n in sorted(grads)]),
                        "update": torch.cat([(end[n] - start[n]).flatten() for n in sorted(end)]),
                        "start": torch.cat([start[n].flatten() for n in sorted(start)]),
                        "applied": result.policy_version == 1}
        worker.shutdown()
    torch.save(results, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("knobs")
    dirs = {"reference": make_tiny_hf_model(root / "reference", "llama", tied=True, seed=0),
            "policy": make_tiny_hf_model(root / "policy", "llama", tied=True, seed=1)}
    plan = planned_runs()
    out = root / "runs.pt"
    mp.spawn(_rank_main, args=(dirs, plan, free_ports(len(plan)), str(out)), nprocs=1, join=True)
    results = torch.load(out)
    assert all(r["applied"] for r in results.values())
    return results


def _diff(a: dict, b: dict, what: str) -> tuple[float, float]:
    """(largest element difference, the baseline's largest element) of ``what``."""
    return float((a[what] - b[what]).abs().max()), float(b[what].abs().max())


def _still_tolerance(base: dict, what: str, scale: float) -> float:
    """1e-6 of the baseline's largest element; for an update (θ after − θ before, in float32) plus two float32
    roundings of the largest weight, the noise of forming θ + Δ."""
    rounding = 2 * torch.finfo(torch.float32).eps * float(base["start"].abs().max()) if what == "update" else 0.0
    return 1e-6 * scale + rounding


@pytest.mark.parametrize("knob", KNOBS, ids=[f"{k.setting}={k.overrides}" for k in KNOBS])
def test_the_setting_moves_the_update_it_documents(knob, runs):
    base = runs[_run_key(knob.moves_in, knob.base)]
    on = runs[_run_key(knob.moves_in, {**knob.base, **knob.overrides})]
    diff, scale = _diff(on, base, knob.what)
    assert scale > 0 and diff > 1e-3 * scale, (knob.setting, knob.moves_in, diff, scale)
    if knob.check is not None:
        CHECKS[knob.check[0]](knob, runs, base, on)


@pytest.mark.parametrize("knob", [k for k in KNOBS if k.still_in],
                         ids=[f"{k.setting}={k.overrides}" for k in KNOBS if k.still_in])
def test_the_setting_does_not_move_the_update_where_documented_not_to(knob, runs):
    for context, why in knob.still_in.items():
        if knob.setting == "train.max_grad_norm":  # two bounds far above the norm
            base, on = runs[_run_key("moved", {})], runs[_run_key("moved", {"max_grad_norm": 1e5})]
        else:
            base = runs[_run_key(context, knob.base)]
            on = runs[_run_key(context, {**knob.base, **knob.overrides})]
        diff, scale = _diff(on, base, knob.what)
        assert diff <= _still_tolerance(base, knob.what, scale), (knob.setting, context, why, diff, scale)


def _linear(knob, runs, base, on):
    """The term is linear in its coefficient: g(2c) − g(0) = 2 (g(c) − g(0))."""
    twice = runs[_run_key(knob.moves_in, {**knob.base, **knob.check[1]})]
    torch.testing.assert_close(twice["grad"] - base["grad"], 2 * (on["grad"] - base["grad"]), rtol=1e-3,
                               atol=1e-6 * float(base["grad"].abs().max()))


def _scaled_by_cap(knob, runs, base, on):
    """Engine logprobs of −25 put every truncated weight at the cap: the pg gradient times 1.5 (no KL, no entropy)."""
    far_base, far_on = runs[_run_key("far", knob.base)], runs[_run_key("far", {**knob.base, **knob.overrides})]
    torch.testing.assert_close(far_on["grad"], 1.5 * far_base["grad"], rtol=1e-4,
                               atol=1e-6 * float(far_base["grad"].abs().max()))
    assert far_on["metrics"]["actor/tis_weight_mean"] == pytest.approx(1.5)


def _update_linear_in_lr(knob, runs, base, on):
    """AdamW's first step without weight decay is −lr·m̂/(√v̂ + ε): twice the lr, twice the update."""
    torch.testing.assert_close(on["update"], 2 * base["update"], rtol=1e-4, atol=4e-7)  # float32 θ + Δ rounding


def _decoupled_decay(knob, runs, base, on):
    """Decoupled weight decay (AdamW) first scales θ by 1 − lr·wd, then adds the same Adam step: the updates differ
    by −lr·wd·θ₀."""
    torch.testing.assert_close(on["update"] - base["update"], -1e-3 * 0.1 * base["start"], rtol=1e-3, atol=4e-7)


def _clipped_to_norm(knob, runs, base, on):
    """The gradient the optimizer sees is the raw one times max_grad_norm / ‖g‖."""
    norm = float(base["grad"].norm())
    assert norm > 1e-2
    torch.testing.assert_close(on["grad"], base["grad"] * (1e-3 / norm), rtol=1e-4, atol=1e-12)


CHECKS = {"linear": _linear, "scaled_by_cap": _scaled_by_cap, "update_linear_in_lr": _update_linear_in_lr,
          "decoupled_decay": _decoupled_decay, "clipped_to_norm": _clipped_to_norm}
