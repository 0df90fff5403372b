"""Weight-sync throughput: the production sender (``weight_sync.sender.stream_buckets``) over the bucketed
broadcast (gloo) and the shared-memory IPC transport (``weight_sync.transport``), against one raw single-buffer
broadcast of the same bytes on the same backend; optionally the real path into a vLLM engine.

Transport mode (default). Payloads: (a) SmolLM2-135M-Instruct's parameters as the trainer streams them (HF names,
tied embedding once, float32, ~538 MB, read from the model's safetensors file) and (b) a synthetic set of
``--synthetic-tensors`` tensors of ``--synthetic-numel`` float32 each (default 64 x 4M = 1 GiB). The sender is this
process (rank 0, hosting the TCPStore); 1 and 2 receiver processes (``torch.multiprocessing``, spawn) join one
``SyncGroup`` per receiver count. They are bare receivers, not vLLM engines (a vLLM engine per receiver for a 1 GB
model does not fit beside the rest on a 24 GiB machine): each receives every bucket into a buffer it owns and
unpacks it into per-tensor views, as the engine's worker extension does before ``load_weights``. Both sides build
the same bucket plan (``plan_buckets``) from the tensor list.

* broadcast (``--bucket-mb`` sizes, default 1, 16, 64, 256, 512 MB): ``stream_buckets`` with a
  ``BroadcastSender`` — each tensor copied into its bucket buffer as it is "gathered", (with ``--verify``) CRC-32s,
  an async broadcast while the next bucket is packed (double buffering) — and ``BroadcastReceiver`` on the other side.
* shm (same bucket sizes): ``stream_buckets`` with a ``ShmSender`` (two ``/dev/shm`` slots, ready/ack keys in the
  group's TCPStore); each ``ShmReceiver`` copies the slot into its own buffer and acknowledges.
* raw: one broadcast of a preallocated, already-filled buffer of the payload's bytes into a preallocated buffer on
  every receiver: the broadcast transport's ceiling on the same backend (no packing, unpacking or allocation).

Timed, per repetition (median of ``--repeats``): from the sender's first pack until every receiver has reported
completion through the TCPStore, so the time includes the receivers' unpacking/checksums. GB/s = payload bytes
(sum of tensor bytes, 1 GB = 1e9 B) / seconds; "x raw" = GB/s / raw GB/s for the same payload and receivers.
"sender s" is when the sender's loop returned. "peak MB (acct/RSS)" is the sender's extra memory during the sync:
accounted (its two bucket buffers + one tensor and a cast copy) / measured (resident-set high-water above the level
at the start, sampled every 2 ms; glibc keeps freed buffers in its heap, so the RSS figure is an upper bound). A
64 MB broadcast warms each group up first. With N receivers gloo's root sends the bytes to each of them, so GB/s is
per receiver, not aggregate.

Engine mode (``--engine``): a :class:`rollout_workers.vllm.engine.VLLMEngine` (vLLM, in-process; its worker runs in a
process vLLM spawns) and SmolLM2's parameters at ``--engine-bucket-mb`` (64) MB buckets. The sender's ``SyncGroup``
is built in a thread while ``VLLMEngine.init_weight_sync`` joins from the main thread; each sync runs the sender's
pack-and-broadcast loop in a thread while the main thread calls ``VLLMEngine.receive_weights`` (receive, unpack,
``load_weights`` through vLLM's layerwise reload, tied-head refresh, prefix-cache reset). Timed: the wall-clock of
both together; the engine's own receive+load seconds are reported too. A greedy probe completion before and after
the syncs must be identical (the same weights are sent back), and with ``--verify`` every tensor's CRC-32 is
compared.

LoRA adapter sync (``--engine --lora-rank R``): the payload is instead the ``lora_A``/``lora_B`` tensors of rank-R
PEFT adapters on every linear layer of SmolLM2 (alpha = 2R, B drawn from N(0, 0.02²) so the policy differs from the
base), under PEFT's saved names, as ``train.lora.sync: adapter`` streams them (``LoraPolicy.adapter_sources``). The
engine starts with vLLM's LoRA support (``VLLMEngine(lora=...)``), receives them, writes the adapter folder and
loads it with vLLM's LoRA loader (timed as "engine receive+load"). Check: the engine's prompt logprobs of a fixed
probe under the adapter against transformers' on PEFT's ``merge_and_unload`` of the same adapters (max |Δ| reported;
must be < 1e-3 natural-log units), and the base's without the adapter. ``sync: merged`` streams the full model's
tensors, i.e. the plain ``--engine`` run.

Usage (from the repo root)::

    .venv/bin/python -m bench.bench_sync                  # both payloads, 1 and 2 receivers, 5 bucket sizes + raw
    .venv/bin/python -m bench.bench_sync --quick --verify
    .venv/bin/python -m bench.bench_sync --engine --verify
    .venv/bin/python -m bench.bench_sync --engine --verify --lora-rank 8
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import threading
import time

from bench._common import DEFAULT_MODEL, load_note, print_json, print_table, resolve_model

MB = 2**20
HOST = "127.0.0.1"


def machine_line(args) -> dict:
    end = load_note()
    print(f"machine: {end['cpus']} CPUs, load average {args.load_start['loadavg_1m']} at start, "
          f"{end['loadavg_1m']} at end (above ~{end['cpus']}, other processes shared the cores)")
    return {"start": args.load_start, "end": end}


# ---------------------------------------------------------------------------------------------------- payloads
def smollm2_tensors(model_path: str) -> dict:
    """SmolLM2's parameters as HF-named float32 tensors (the checkpoint has no lm_head: it is tied)."""
    from pathlib import Path

    from safetensors.torch import load_file

    import torch

    state = load_file(str(Path(model_path) / "model.safetensors"))
    return {k: v.to(torch.float32).contiguous() for k, v in state.items()}


def synthetic_tensors(count: int, numel: int, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {f"synthetic.{i}.weight": torch.rand(numel, generator=g) for i in range(count)}


def specs_of(tensors: dict) -> list[tuple[str, tuple[int, ...], str]]:
    from weight_sync.buckets import dtype_name

    return [(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in tensors.items()]


def plan_of(specs, bucket_bytes: int):
    from weight_sync.buckets import plan_buckets, to_dtype

    return plan_buckets([(n, s, to_dtype(d)) for n, s, d in specs], bucket_bytes)


def payload_bytes(specs) -> int:
    import torch

    from weight_sync.buckets import to_dtype

    total = 0
    for _, shape, dt in specs:
        n = 1
        for s in shape:
            n *= s
        total += n * torch.empty((), dtype=to_dtype(dt)).element_size()
    return total


def digest(checksums: dict[str, int]) -> int:
    """One CRC over all per-tensor CRCs (sorted by name), to compare sender and receiver in one number."""
    import zlib

    return zlib.crc32(json.dumps(sorted(checksums.items())).encode())


# ---------------------------------------------------------------------------------------------------- sender side
def send_buckets(group, buckets, tensors: dict, verify: bool) -> dict[str, int]:
    """The production sender loop over a broadcast (``stream_buckets`` + ``BroadcastSender``); returns checksums."""
    import torch

    from weight_sync.sender import stream_buckets
    from weight_sync.transport import BroadcastSender

    check = list(tensors) if verify else []
    return stream_buckets(buckets, tensors.__getitem__, BroadcastSender(group, torch.device("cpu")),
                          check)["checksums"]


# ---------------------------------------------------------------------------------------------------- receiver side
class _StoreView:
    """A receiver-side view of the bench's gloo group exposing only what the shm transport uses (store, rank)."""

    def __init__(self, group):
        self.store, self.rank, self.world_size = group.store, group.rank, group.world_size

    def close(self) -> None:
        pass


def _receiver_main(rank: int, world: int, port: int, schedule: list[dict], verify: bool, copy: bool,
                   timeout_s: float) -> None:
    """One receiver process: join the group, then follow the schedule; report each repetition via the store."""
    import torch

    from weight_sync.buckets import bucket_checksums, unpack_bucket
    from weight_sync.group import SyncGroup
    from weight_sync.transport import BroadcastReceiver, ShmReceiver

    torch.set_num_threads(1)
    group = SyncGroup(HOST, port, rank, world, timeout_s)
    warm = torch.empty(64 * MB, dtype=torch.uint8)
    group.broadcast(warm)
    del warm
    for e, exp in enumerate(schedule):
        specs = exp["specs"]
        dest = None
        if copy and exp["mode"] != "raw":
            from weight_sync.buckets import to_dtype

            dest = {n: torch.empty(s, dtype=to_dtype(d)) for n, s, d in specs}
        if exp["mode"] == "raw":
            raw = torch.empty(payload_bytes(specs), dtype=torch.uint8)
        else:
            buckets = plan_of(specs, exp["bucket_bytes"])
        if exp["mode"] == "shm":
            group.store.wait([f"desc/{e}"])
            rx = ShmReceiver(_StoreView(group), json.loads(group.store.get(f"desc/{e}")))
        elif exp["mode"] == "broadcast":
            rx = BroadcastReceiver(group, torch.device("cpu"))
        for rep in range(exp["repeats"]):
            checksums: dict[str, int] = {}
            if exp["mode"] == "raw":
                group.broadcast(raw)
            else:
                rx.begin()
                for bucket in buckets:
                    buf = rx.receive(bucket)
                    views = unpack_bucket(bucket, buf)
                    if verify:
                        checksums.update(bucket_checksums(bucket, buf))
                    if dest is not None:
                        for name, view in views:
                            dest[name].copy_(view)
                    del buf, views
            group.store.set(f"done/{e}/{rep}/{rank}", str(digest(checksums) if verify else 0))
        if exp["mode"] == "raw":
            del raw
        rx = dest = None
        gc.collect()


def run_transport(receivers: int, schedule: list[dict], payloads: dict, verify: bool, copy: bool,
                  timeout_s: float) -> list[dict]:
    """Spawn ``receivers`` processes, run the schedule as sender, return one result row per experiment."""
    import torch
    import torch.multiprocessing as mp

    from weight_sync.group import SyncGroup, free_port
    from weight_sync.sender import stream_buckets
    from weight_sync.transport import BroadcastSender, ShmSender

    world = 1 + receivers
    port = free_port(HOST)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_receiver_main, args=(r, world, port, schedule, verify, copy, timeout_s),
                         daemon=True) for r in range(1, world)]
    for p in procs:
        p.start()
    group = SyncGroup(HOST, port, 0, world, timeout_s)
    group.broadcast(torch.zeros(64 * MB, dtype=torch.uint8))
    rows = []
    try:
        for e, exp in enumerate(schedule):
            tensors = payloads[exp["payload"]]
            nbytes = payload_bytes(exp["specs"])
            sender = buckets = None
            if exp["mode"] == "raw":
                raw = torch.empty(nbytes, dtype=torch.uint8)
                offset = 0
                for t in tensors.values():  # fill it with the payload's bytes (not timed)
                    flat = t.reshape(-1).view(torch.uint8)
                    raw[offset:offset + flat.numel()].copy_(flat)
                    offset += flat.numel()
            else:
                buckets = plan_of(exp["specs"], exp["bucket_bytes"])
                if exp["mode"] == "shm":
                    sender = ShmSender(group, max(b.nbytes for b in buckets))
                    group.store.set(f"desc/{e}", json.dumps(sender.descriptor()))
                else:
                    sender = BroadcastSender(group, torch.device("cpu"))
            check = list(tensors) if verify else []
            times, sender_times, peaks, ok = [], [], [], True
            for rep in range(exp["repeats"]):
                t0 = time.perf_counter()
                if exp["mode"] == "raw":
                    group.broadcast(raw)
                    sent = {}
                else:
                    report = stream_buckets(buckets, tensors.__getitem__, sender, check)
                    sent = report["checksums"]
                    peaks.append((report["peak_extra_bytes_accounted"], report["peak_extra_bytes"]))
                sender_times.append(time.perf_counter() - t0)
                keys = [f"done/{e}/{rep}/{r}" for r in range(1, world)]
                group.store.wait(keys)
                times.append(time.perf_counter() - t0)
                if verify and exp["mode"] != "raw":
                    ok = ok and all(int(group.store.get(k)) == digest(sent) for k in keys)
            if exp["mode"] == "raw":
                del raw
            if exp["mode"] == "shm":
                sender._finalizer()  # unlink the slots (their pages go once the receivers drop them)
            sender = None
            gc.collect()
            seconds = statistics.median(times)
            rows.append({"payload": exp["payload"], "receivers": receivers, "mode": exp["mode"],
                         "bucket_mb": exp["bucket_bytes"] // MB if exp["bucket_bytes"] else None,
                         "buckets": len(buckets) if buckets else 1, "bytes": nbytes, "seconds": seconds,
                         "all_seconds": times, "sender_seconds": statistics.median(sender_times),
                         "peak_accounted": max((p[0] for p in peaks), default=None),
                         "peak_rss": max((p[1] for p in peaks), default=None),
                         "gb_per_s": nbytes / seconds / 1e9,
                         "verified": (ok if verify and exp["mode"] != "raw" else None)})
            r = rows[-1]
            print(f"  {r['payload']:>9} recv={receivers} {r['mode']:>9} "
                  f"{(str(r['bucket_mb']) + 'MB') if r['bucket_mb'] else '':>6}: {seconds:.3f}s "
                  f"{r['gb_per_s']:.2f} GB/s", flush=True)
    finally:
        for p in procs:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.kill()
    for p in procs:
        if p.exitcode not in (0, None):
            raise RuntimeError(f"receiver process exited with code {p.exitcode}")
    return rows


def transport_main(args, model_path: str) -> None:
    payloads = {}
    if "smollm2" in args.payloads:
        payloads["smollm2"] = smollm2_tensors(model_path)
    if "synthetic" in args.payloads:
        payloads["synthetic"] = synthetic_tensors(args.synthetic_tensors, args.synthetic_numel)
    schedule = []
    for name, tensors in payloads.items():
        specs = specs_of(tensors)
        for mode in args.modes:
            for mb in args.bucket_mb:
                schedule.append({"payload": name, "specs": specs, "mode": mode, "bucket_bytes": int(mb * MB),
                                 "repeats": args.repeats})
        schedule.append({"payload": name, "specs": specs, "mode": "raw", "bucket_bytes": None,
                         "repeats": args.repeats})
        print(f"payload {name}: {len(specs)} tensors, {payload_bytes(specs) / 1e6:.1f} MB", flush=True)
    print(f"gloo on {HOST}; transports {args.modes}, bucket sizes {args.bucket_mb} MB + raw broadcast; median of "
          f"{args.repeats}; verify={args.verify} copy={args.copy}", flush=True)
    rows = []
    for n in args.receivers:
        rows += run_transport(n, schedule, payloads, args.verify, args.copy, args.timeout_s)

    raw = {(r["payload"], r["receivers"]): r["gb_per_s"] for r in rows if r["mode"] == "raw"}
    for r in rows:
        r["x_raw"] = r["gb_per_s"] / raw[(r["payload"], r["receivers"])]
    print()

    def peak(r) -> str:
        if r["peak_accounted"] is None:
            return "-"
        return f"{r['peak_accounted'] / 1e6:.0f}/{r['peak_rss'] / 1e6:.0f}"

    print_table(["payload", "recv", "transport", "bucket", "buckets", "MB", "seconds", "GB/s", "x raw", "sender s",
                 "peak MB (acct/RSS)", "checksums"],
                [[r["payload"], r["receivers"], r["mode"], f"{r['bucket_mb']}MB" if r["bucket_mb"] else "-",
                  r["buckets"], r["bytes"] / 1e6, r["seconds"], r["gb_per_s"], r["x_raw"], r["sender_seconds"],
                  peak(r), {None: "-", True: "ok", False: "MISMATCH"}[r["verified"]]] for r in rows])
    best = {}
    for r in rows:
        if r["mode"] != "raw":
            key = (r["payload"], r["receivers"], r["mode"])
            if key not in best or r["gb_per_s"] > best[key]["gb_per_s"]:
                best[key] = r
    print("\nbest bucket size per payload/receivers/transport:")
    for (payload, recv, mode), r in sorted(best.items()):
        print(f"  {payload:>9} recv={recv} {mode:>9}: {r['bucket_mb']} MB, {r['seconds']:.3f} s, "
              f"{r['gb_per_s']:.2f} GB/s = {r['x_raw']:.2f}x raw")
    machine = machine_line(args)
    print_json("sync", {"machine": machine, "mode": "transport", "backend": "gloo", "verify": args.verify,
                        "copy": args.copy,
                        "repeats": args.repeats, "results": rows})
    if args.verify and any(r["verified"] is False for r in rows):
        raise SystemExit("checksum mismatch")


# ---------------------------------------------------------------------------------------------------- engine mode
PROBE_IDS = [1, 504, 3458, 282, 4649, 314, 253, 2]  # short fixed token prompt


def lora_payload(model_path: str, rank: int):
    """Rank-``rank`` adapters on every linear layer of the model (B ~ N(0, 0.02²)): (adapter tensors under PEFT's
    saved names, the ``LoraSpec``, the PEFT adapter config, transformers' prompt logprobs of ``PROBE_IDS`` under
    the merged model [len - 1] float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from cluster.spec import LoraSpec
    from train_workers.lora import LoraPolicy, add_adapters

    lora = LoraSpec(rank=rank, alpha=2.0 * rank, sync="adapter")
    torch.manual_seed(0)
    peft_model = add_adapters(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), lora)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    policy = LoraPolicy(peft_model, with_reference=False)
    tensors = {name: gather().contiguous() for name, _, gather in policy.adapter_sources()}
    config = policy.adapter_config()
    merged = peft_model.merge_and_unload()
    with torch.no_grad():
        logits = merged(torch.tensor([PROBE_IDS])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(PROBE_IDS[1:])[:, None])[:, 0]
    return tensors, lora, config, lp


def engine_main(args, model_path: str) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from cluster.spec import RolloutSpec
    from rollout_workers.vllm.engine import VLLMEngine
    from weight_sync.group import SyncGroup, free_port

    lora = adapter_config = merged_lp = None
    if args.lora_rank:
        tensors, lora, adapter_config, merged_lp = lora_payload(model_path, args.lora_rank)
        what = f"SmolLM2 LoRA adapters (rank {args.lora_rank}, all-linear)"
    else:
        tensors, what = smollm2_tensors(model_path), "SmolLM2"
    specs = specs_of(tensors)
    nbytes = payload_bytes(specs)
    buckets = plan_of(specs, int(args.engine_bucket_mb * MB))
    print(f"{what}: {len(specs)} tensors, {nbytes / 1e6:.3f} MB, {len(buckets)} buckets of <= "
          f"{args.engine_bucket_mb} MB; verify={args.verify}", flush=True)

    spec = RolloutSpec(max_response_tokens=16, kv_cache_gib=1.0, max_model_len=512, enforce_eager=True)
    t0 = time.perf_counter()
    engine = VLLMEngine(model_path, spec, dtype="float32", seed=0, max_model_len=512, lora=lora)
    startup_s = time.perf_counter() - t0

    probe = [TokensPrompt(prompt_token_ids=PROBE_IDS)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)

    def probe_ids() -> list[int]:
        return list(engine.llm.generate(probe, greedy, use_tqdm=False)[0].outputs[0].token_ids)

    def probe_logprobs(lora_request) -> list[float]:
        params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0)
        out = engine.llm.generate(probe, params, use_tqdm=False, lora_request=lora_request)[0]
        return [step[t].logprob for t, step in zip(PROBE_IDS[1:], out.prompt_logprobs[1:])]

    before = probe_ids()

    port = free_port(HOST)
    box: dict = {}

    def make_sender():
        box["group"] = SyncGroup(HOST, port, 0, 2, args.timeout_s)

    t0 = time.perf_counter()
    th = threading.Thread(target=make_sender)
    th.start()
    engine.init_weight_sync(HOST, port, 1, 2, buckets, args.timeout_s, adapter_config=adapter_config)
    th.join()
    init_s = time.perf_counter() - t0
    group = box["group"]

    rows, ok = [], True
    for rep in range(args.repeats):
        out: dict = {}

        def send():
            s0 = time.perf_counter()
            out["checksums"] = send_buckets(group, buckets, tensors, args.verify)
            out["seconds"] = time.perf_counter() - s0

        t0 = time.perf_counter()
        th = threading.Thread(target=send)
        th.start()
        report = engine.receive_weights(policy_version=rep + 1, verify=args.verify)
        th.join()
        seconds = time.perf_counter() - t0
        match = None
        if args.verify:
            match = all(c == out["checksums"] for c in report.worker_checksums)
            ok = ok and match
        rows.append({"rep": rep, "seconds": seconds, "engine_seconds": report.seconds,
                     "sender_seconds": out["seconds"], "gb_per_s": nbytes / seconds / 1e9, "verified": match})
        print(f"  sync {rep}: {seconds:.3f}s ({nbytes / seconds / 1e9:.2f} GB/s), engine receive+load "
              f"{report.seconds:.3f}s, sender {out['seconds']:.3f}s", flush=True)
    after = probe_ids()
    same = before == after
    lora_diff = None
    if lora is not None:  # the adapter changes the policy: compare with transformers on the merged model instead
        served = probe_logprobs(engine.lora_request)
        lora_diff = max(abs(a - float(b)) for a, b in zip(served, merged_lp))
        base_diff = max(abs(a - float(b)) for a, b in zip(probe_logprobs(None), merged_lp))
        print(f"engine prompt logprobs with the adapter vs transformers merge_and_unload: max |diff| "
              f"{lora_diff:.2e}; the engine without it (the base) vs merged: {base_diff:.2e}")
        same = lora_diff < 1e-3
    try:
        engine.llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # best effort
        print(f"(engine shutdown: {exc!r})")

    med = statistics.median(r["seconds"] for r in rows)
    print()
    print_table(["sync", "seconds", "GB/s", "engine recv+load s", "sender s", "checksums"],
                [[r["rep"], r["seconds"], r["gb_per_s"], r["engine_seconds"], r["sender_seconds"],
                  {None: "-", True: "ok", False: "MISMATCH"}[r["verified"]]] for r in rows])
    check = "adapter logprobs = merged transformers'" if lora is not None else "greedy probe unchanged after syncs"
    print(f"\nmedian {med:.3f}s = {nbytes / med / 1e9:.2f} GB/s for {nbytes / 1e6:.3f} MB at "
          f"{args.engine_bucket_mb} MB buckets; engine start {startup_s:.1f}s, group init {init_s:.2f}s; "
          f"{check}: {same}")
    machine = machine_line(args)
    print_json("sync", {"machine": machine, "mode": "engine", "backend": "gloo",
                        "bucket_mb": args.engine_bucket_mb,
                        "buckets": len(buckets), "bytes": nbytes, "verify": args.verify,
                        "seconds": med, "gb_per_s": nbytes / med / 1e9, "syncs": rows, "startup_s": startup_s,
                        "group_init_s": init_s, "probe_unchanged": same, "lora_rank": args.lora_rank,
                        "lora_logprob_max_abs_diff": lora_diff})
    if not same or not ok:
        raise SystemExit("engine weights differ after sync (probe or checksums)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[1, 16, 64, 256, 512])
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=["broadcast", "shm"], choices=["broadcast", "shm"],
                        help="bucketed transports to measure (raw broadcast always runs)")
    parser.add_argument("--payloads", nargs="+", default=["smollm2", "synthetic"], choices=["smollm2", "synthetic"])
    parser.add_argument("--synthetic-tensors", type=int, default=64)
    parser.add_argument("--synthetic-numel", type=int, default=4 * 2**20, help="float32 elements per tensor")
    parser.add_argument("--repeats", type=int, default=2, help="repetitions per row (median reported)")
    parser.add_argument("--verify", action="store_true", help="CRC-32 every tensor on both sides and compare")
    parser.add_argument("--copy", action="store_true", help="receivers copy each tensor into a destination")
    parser.add_argument("--engine", action="store_true", help="measure the real path into a vLLM engine")
    parser.add_argument("--engine-bucket-mb", type=float, default=64)
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="engine mode: stream rank-R LoRA adapters (train.lora.sync: adapter); 0: full weights")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: synthetic 8 x 1M, SmolLM2, buckets 1 and 64 MB, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.synthetic_tensors, args.synthetic_numel = 8, 2**20
        args.bucket_mb, args.repeats = [1, 64], 1
    model_path = resolve_model(args.model)
    args.load_start = load_note()
    if args.engine:
        engine_main(args, model_path)
    else:
        transport_main(args, model_path)


if __name__ == "__main__":
    main()
