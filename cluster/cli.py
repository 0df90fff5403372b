"""``grpo-cluster`` command line.

    grpo-cluster run SPEC.yaml [--set dotted.key=value ...] [--address ray://... | auto]
    grpo-cluster eval --model DIR --data FILE [--limit N]
"""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_run(args) -> int:
    from cluster.spec import SpecError, load_spec

    try:
        spec = load_spec(args.spec, args.set or ())
    except SpecError as exc:
        print(f"grpo-cluster: invalid spec:\n{exc}", file=sys.stderr)
        return 2
    from cluster.data import DataError
    from cluster.driver import GRPOJob, SetupError
    from cluster.metrics import MetricsError
    from cluster.models import ModelError
    from cluster.pools import InsufficientResources

    address = args.address or spec.ray.address
    if address and not _reachable(address):
        print(f"grpo-cluster: cannot reach a Ray cluster at {address} (ray.address / --address)", file=sys.stderr)
        return 2
    try:  # data, model and output-folder problems surface here, before any cluster starts
        job = GRPOJob(spec, progress=not args.no_progress)
    except (DataError, ModelError, MetricsError, SetupError) as exc:
        print(f"grpo-cluster: {exc}", file=sys.stderr)
        return 2
    import ray

    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=spec.ray.num_cpus, include_dashboard=False, dashboard_host=spec.ray.dashboard_host,
                 log_to_driver=True)
    try:
        history = job.run()
    except InsufficientResources as exc:
        print(f"grpo-cluster: {exc}", file=sys.stderr)
        return 2
    finally:
        job.close()
        ray.shutdown()
    last = history[-1] if history else {}
    print(f"[grpo-cluster] done: {len(history)} steps, final reward/mean {last.get('reward/mean', float('nan')):.3f}, "
          f"metrics in {job.output_dir / 'metrics.jsonl'}", file=sys.stderr)
    return 0


def _reachable(address: str, timeout_s: float = 5.0) -> bool:
    """For a ``host:port`` GCS address, whether a TCP connection opens within ``timeout_s`` (Ray itself retries for
    minutes). Other forms (``auto``, ``ray://``) are left to Ray."""
    import socket

    host, sep, port = address.rpartition(":")
    if address == "auto" or "://" in address or not sep or not port.isdigit():
        return True
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _cmd_eval(args) -> int:
    from cluster.data import DataError
    from cluster.evaluate import evaluate_gsm8k
    from cluster.models import ModelError

    try:
        result = evaluate_gsm8k(args.model, args.data, limit=args.limit, max_tokens=args.max_tokens)
    except (DataError, ModelError, ValueError, OSError) as exc:
        print(f"grpo-cluster eval: {exc}", file=sys.stderr)
        return 2
    print(f"GSM8K pass@1 = {result['pass@1']:.4f} on {result['n']} problems "
          f"(format {result['format']:.3f}, mean length {result['mean_tokens']:.0f} tokens, "
          f"truncated {result['truncated']:.2f}, {result['tokens_per_s']:.0f} tok/s)")
    if args.json:
        print(json.dumps({"model": args.model, **result}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-cluster", description="GRPO training on Ray with vLLM and FSDP2.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job spec on a local Ray cluster (or join --address)")
    run.add_argument("spec", help="job spec YAML")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a spec field (repeatable)")
    run.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(func=_cmd_run)
    ev = sub.add_parser("eval", help="GSM8K pass@1 of a model folder (greedy, vLLM)")
    ev.add_argument("--model", required=True, help="HF model folder, builtin:<name> or hub id")
    ev.add_argument("--data", required=True, help="GSM8K jsonl (question, answer)")
    ev.add_argument("--limit", type=int, default=None, help="first N rows only")
    ev.add_argument("--max-tokens", type=int, default=256, help="generation cap per problem")
    ev.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    ev.set_defaults(func=_cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("grpo-cluster: interrupted; checkpoints already written are kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
