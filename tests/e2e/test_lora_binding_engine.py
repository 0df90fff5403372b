"""The real vLLM engine's LoRA binding report (issue 30, item 3): after an adapter sync through the production path
(``RolloutEngine.init_weight_sync`` + ``receive_weights`` with the trainer's sender, ``stream_buckets``, in a thread),
the engine reads from vLLM's LoRA manager which modules the adapter is bound to (``ReceiveReport.
worker_adapter_modules``): all 14 targets of the tiny Llama (q/k/v packed as ``qkv_proj``, gate/up as
``gate_up_proj``, counted as their parts). The same adapter streamed under another model's prefix
(``decoder.layers...``: what an engine upgrade or a renamed model looks like) is loaded by vLLM without an error and
binds nothing: the report is empty and ``check_adapter_binding`` stops the sync naming the modules (~1.5 min).

    flock /tmp/grpo-heavy.lock .venv/bin/python -m pytest tests/e2e/test_lora_binding_engine.py -m slow -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from weight_sync.verify import AdapterSyncError, adapter_targets, check_adapter_binding

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

# A fresh interpreter: vLLM spawns its own engine processes (needs the __main__ guard).
SCRIPT = textwrap.dedent("""
    import json, sys, threading

    def main(path):
        import torch
        from transformers import AutoModelForCausalLM

        from cluster.spec import LoraSpec, RolloutSpec
        from rollout_workers.engine import RolloutEngine
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
        engine = RolloutEngine(path, RolloutSpec(max_response_tokens=4, kv_cache_gib=1.0, max_model_len=256,
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


def test_engine_reports_the_modules_its_adapter_is_bound_to(tmp_path, tiny_model_dir):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(script), tiny_model_dir], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    good, renamed = out["1"], out["2"]
    targets = adapter_targets(good["names"])
    assert len(targets) == 14 and targets[0] == "model.layers.0.mlp.down_proj"
    assert good["modules"] == [targets] and good["served"] == 1  # one worker, every target, HF names
    check_adapter_binding(targets, good["modules"][0], "engine 0 worker 0")
    assert renamed["modules"] == [[]] and renamed["served"] == 2  # loaded and "served", bound to nothing
    with pytest.raises(AdapterSyncError, match=r"bound to 0 module\(s\), the trainer targets 14: unbound "
                                               r"\['decoder.layers.0.mlp.down_proj'"):
        check_adapter_binding(adapter_targets(renamed["names"]), renamed["modules"][0], "engine 0 worker 0")
