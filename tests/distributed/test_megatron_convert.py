"""HF ⇄ Megatron-core weight conversion (train_workers/megatron/convert.py) on real GPTModels over gloo.

Two random fp32 models of tests/megatron_cpu.py's shape (4 layers, hidden 64, 4 heads, 2 kv heads, vocabulary 1100,
padded to 1152 at tp=1 and 1280 at tp=2): a Llama with tied embeddings (SmolLM2's shape) and a Qwen2 with untied
embeddings and q/k/v biases. Each is converted to every layout of ``LAYOUTS`` on 2 gloo ranks
(``torch.multiprocessing.spawn``; tp=1/pp=1 runs as 2 data-parallel replicas), loaded with ``load_state_dict`` (every
parameter name and shape must match), and run on a right-padded batch of 3 rows with Megatron's own forward (pipeline
stages pass the hidden states with ``dist.send``/``recv`` and ``set_input_tensor``, as Megatron's schedules do).
Checked: next-token logprobs on the valid positions equal the HF model's within 1e-5 (fp32), and gathering every
rank's ``state_dict()`` back to HF names gives every HF tensor bit-exactly (``torch.equal``).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from tests.megatron_cpu import make_tiny_hf_model
from weight_sync.group import free_port

pytest.importorskip("megatron.core")

ATOL = 1e-5
MODELS = {"llama_tied": ("llama", True), "qwen2_untied": ("qwen2", False)}
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) on 2 ranks
LENGTHS = [12, 9, 5]  # right padding to 12


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (len(LENGTHS), max(LENGTHS)), generator=g)
    valid = torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]
    return ids * valid, valid


def _logprobs(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """logits [B, T, >= V] → [B, T-1] float32 log p(ids[:, t+1] | ids[:, :t+1]); padded-vocab columns dropped."""
    logp = torch.log_softmax(logits[..., :vocab].float(), dim=-1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


def _megatron_forward(model, ids: torch.Tensor, hidden_size: int) -> torch.Tensor | None:
    """Run the pipeline: [B, T] → full-vocab logits [B, T, Vp] on the last stage, None elsewhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    b, t = ids.shape
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)[None, None].expand(b, 1, t, t)  # True: masked
    positions = torch.arange(t)[None].expand(b, t)
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(t, b, hidden_size)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=positions, attention_mask=mask)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return out


def _rank(rank: int, world: int, port: int, dirs: dict[str, str], out_path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from transformers import AutoModelForCausalLM

    from tests.megatron_cpu import install_cpu_shims
    from train_workers.megatron.config import check_megatron_layout, gpt_model_kwargs, read_hf_config, \
        transformer_config
    from train_workers.megatron.convert import hf_to_megatron, megatron_to_hf

    torch.set_num_threads(1)
    install_cpu_shims()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for key, path in dirs.items():
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf_sd = hf_model.state_dict()
        cfg = read_hf_config(path)
        ids, valid = _batch(cfg["vocab_size"])
        with torch.no_grad():
            ref = _logprobs(hf_model(input_ids=ids, attention_mask=valid.long()).logits, ids, cfg["vocab_size"])
        for tp, pp in LAYOUTS:
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
            layout = check_megatron_layout(cfg, tp, pp)
            tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
            model = GPTModel(**gpt_model_kwargs(layout, transformer_config(layout), parallel_output=False,
                                                pre_process=ps.is_pipeline_first_stage(),
                                                post_process=ps.is_pipeline_last_stage())).eval()
            missing, unexpected = model.load_state_dict(hf_to_megatron(hf_sd, layout, tp_rank, pp_rank), strict=False)
            case = f"{key}-tp{tp}-pp{pp}"
            bad_missing = [k for k in missing if not k.endswith("_extra_state")]
            logits = _megatron_forward(model, ids, layout.hidden_size)
            shards = [None] * world
            dist.all_gather_object(shards, (pp_rank, tp_rank, model.state_dict()))
            if rank == world - 1:  # on the last stage in every layout
                got = _logprobs(logits, ids, cfg["vocab_size"])
                diff = (got - ref)[valid[:, 1:]].abs().max().item()
                back = megatron_to_hf({(p, t): sd for p, t, sd in shards}, layout)
                want = {k: v for k, v in hf_sd.items() if not (layout.tied_embeddings and k == "lm_head.weight")}
                results[case] = dict(
                    missing=bad_missing, unexpected=list(unexpected), logprob_max_abs_diff=diff,
                    logits_shape=list(logits.shape), key_diff=sorted(set(back) ^ set(want)),
                    not_equal=sorted(k for k in set(back) & set(want) if not torch.equal(back[k], want[k])),
                    dtypes=sorted({str(v.dtype) for v in back.values()}))
            ps.destroy_model_parallel()
    if rank == world - 1:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_convert")
    dirs = {key: make_tiny_hf_model(root / key, model_type, tied) for key, (model_type, tied) in MODELS.items()}
    out = root / "results.json"
    mp.spawn(_rank, args=(2, free_port(), dirs, str(out)), nprocs=2, join=True)
    found = json.loads(out.read_text())
    print({case: f"{r['logprob_max_abs_diff']:.2e}" for case, r in found.items()})  # shown by pytest -rA
    return found


CASES = [f"{key}-tp{tp}-pp{pp}" for key in MODELS for tp, pp in LAYOUTS]


@pytest.mark.parametrize("case", CASES)
def test_megatron_convert_loads_every_parameter(results, case):
    r = results[case]
    assert r["missing"] == [] and r["unexpected"] == []


@pytest.mark.parametrize("case", CASES)
def test_megatron_convert_logprobs_match_hf(results, case):
    r = results[case]
    assert r["logits_shape"][:2] == [len(LENGTHS), max(LENGTHS)]
    assert r["logprob_max_abs_diff"] <= ATOL, r


@pytest.mark.parametrize("case", CASES)
def test_megatron_convert_round_trip_bit_exact(results, case):
    r = results[case]
    assert r["key_diff"] == [] and r["not_equal"] == [] and r["dtypes"] == ["torch.float32"], r
