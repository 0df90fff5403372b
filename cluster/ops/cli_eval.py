"""``grpo-cluster eval``: a model's held-out pass@1, greedy by default, with its 95 % Wilson interval.

    grpo-cluster eval --spec SPEC [--model MODEL] [--set k=v ...] [--limit N] [--max-tokens N]
                      [--engine vllm|transformers] [--per-problem OUT] [--against BASE] [--json]
        # the spec's held-out data, prompt and scorer: the loop's eval/* figures (cluster/ops/spec_eval.py)
    grpo-cluster eval --model MODEL --data FILE [--limit N] [--max-tokens N] [--per-problem OUT] [--against BASE]
        # GSM8K jsonl rows, the default GSM8K prompt and verifier (cluster/data/evaluate.py)

``--per-problem`` writes each problem's outcome and completion (jsonl); ``--against`` (another model's per-problem
file of the same problems) prints gains, losses and McNemar's exact p. Both are checked before the engine starts.
Exit codes: 0 done; 2 bad input (message on stderr, nothing evaluated) or a per-problem file that could not be
written (the figures are printed first).
"""

from __future__ import annotations

import json
import sys

from cluster.ops.cli_args import whole_number


def _read_against(path: str) -> list[dict]:
    """The ``--against`` file's rows; an unreadable file is an OSError naming the flag."""
    from cluster.data.evaluate import read_per_problem

    try:
        return read_per_problem(path)
    except OSError as exc:
        raise OSError(f"--against {path}: cannot read it: {exc.strerror or exc}") from None


def _paired(args, baseline: list[dict] | None, problems: list[dict], summary: dict) -> None:
    """Print the ``--against`` comparison and add it to ``summary`` (nothing without a baseline)."""
    if baseline is None:
        return
    from grpo.stats import paired_comparison

    pairs = [(a["correct"], b["correct"]) for a, b in zip(baseline, problems)]
    both = [(a, b) for a, b in pairs if a is not None and b is not None]  # a problem unscored in either: left out
    left_out = len(pairs) - len(both)
    if not both:
        print(f"against {args.against}: no problem was scored in both runs ({left_out} unscored in either)")
        return
    paired = paired_comparison([a for a, _ in both], [b for _, b in both])
    unscored = f" ({left_out} problems unscored in either run left out)" if left_out else ""
    print(f"against {args.against}: {paired.before} -> {paired.after} correct of {paired.n}{unscored}; "
          f"{paired.gained} gained, {paired.lost} lost; McNemar exact p = {paired.p_value:.3f}")
    summary["paired"] = {**paired._asdict(), "unscored_left_out": left_out}


def _write(args, result: dict) -> str | None:
    """Write ``--per-problem``; the error line to print after the figures, or None."""
    from cluster.data.evaluate import write_per_problem

    if not args.per_problem:
        return None
    try:
        write_per_problem(args.per_problem, result)
    except OSError as exc:  # reported after the figures, which are printed regardless
        return f"grpo-cluster eval: --per-problem {args.per_problem}: not written: {exc}"
    return None


def _finish(args, summary: dict, write_error: str | None) -> int:
    if args.json:
        print(json.dumps(summary))
    if write_error:
        print(write_error, file=sys.stderr)
        return 2
    return 0


def _cmd_eval_data(args) -> int:
    from cluster.data import DataError
    from cluster.data.evaluate import check_same_problems, check_writable, eval_questions, evaluate_gsm8k
    from cluster.data.models import ModelError

    if args.engine != "vllm":
        print("grpo-cluster eval: --engine is for --spec; --data evaluates with vLLM", file=sys.stderr)
        return 2
    try:  # everything that can be checked without the engine, before the (slow) evaluation
        questions = eval_questions(args.data, args.limit)
        baseline = _read_against(args.against) if args.against else None
        if baseline is not None:
            check_same_problems(baseline, questions, args.against)
        if args.per_problem:
            check_writable(args.per_problem, args.data)
        result = evaluate_gsm8k(args.model, args.data, limit=args.limit, model_setting="--model",
                                max_tokens=256 if args.max_tokens is None else args.max_tokens)
    except (DataError, ModelError, ValueError, OSError) as exc:
        print(f"grpo-cluster eval: {exc}", file=sys.stderr)
        return 2
    write_error = _write(args, result)
    print(f"GSM8K pass@1 = {result['pass@1']:.4f} on {result['n']} problems "
          f"(format {result['format']:.3f}, mean length {result['mean_tokens']:.0f} tokens, "
          f"truncated {result['truncated']:.2f}, {result['tokens_per_s']:.0f} tok/s)")
    summary = {"model": args.model, **{k: v for k, v in result.items() if k != "problems"}}
    _paired(args, baseline, result["problems"], summary)
    return _finish(args, summary, write_error)


def _spec_overrides(args) -> list[str]:
    """``--set`` values, then ``--limit`` and ``--max-tokens`` as ``eval.limit`` and ``eval.max_tokens``."""
    out = list(args.set or ())
    if args.limit is not None:
        out.append(f"eval.limit={args.limit}")
    if args.max_tokens is not None:
        out.append(f"eval.max_tokens={args.max_tokens}")
    return out


def _cmd_eval_spec(args) -> int:
    from cluster.data import DataError
    from cluster.data.evaluate import check_same_problems, check_writable
    from cluster.data.models import ModelError
    from cluster.loop.evaluation import unscored_warning
    from cluster.ops.prepare import import_modules
    from cluster.ops.spec_eval import SpecEvalError, evaluate_prepared, prepare_spec_eval, spec_engine
    from cluster.spec import SpecError, load_spec, locate_field_error
    from grpo.rewards import RewardError

    problem = import_modules(args.imports)
    if problem:
        print(f"grpo-cluster eval: {problem}", file=sys.stderr)
        return 2
    overrides = _spec_overrides(args)
    try:
        spec = load_spec(args.spec, overrides)
    except SpecError as exc:
        print(f"grpo-cluster eval: invalid spec:\n{exc}", file=sys.stderr)
        return 2
    try:  # everything that can be checked without the engine, before the (slow) evaluation
        prepared = prepare_spec_eval(spec, args.model)
        baseline = _read_against(args.against) if args.against else None
        if baseline is not None:
            if spec.eval.samples != 1:
                raise ValueError(f"--against compares problems solved or not: expected eval.samples 1, got "
                                 f"{spec.eval.samples}")
            check_same_problems(baseline, prepared.questions, args.against)
        if args.per_problem:
            check_writable(args.per_problem, args.spec)
        with spec_engine(prepared, args.engine) as generate:
            result = evaluate_prepared(prepared, generate)
    except (SpecEvalError, DataError, ModelError, RewardError, ValueError, OSError) as exc:
        print(f"grpo-cluster eval: {locate_field_error(str(exc), args.spec, overrides)}", file=sys.stderr)
        return 2
    write_error = _write(args, result)
    m, ev = result["metrics"], spec.eval
    what = "pass@1" if ev.samples == 1 else f"mean@{ev.samples}"
    fmt = f"format {m['eval/format_rate']:.3f}, " if "eval/format_rate" in m else ""
    unscored = f", {int(m['eval/unscored'])} completions unscored and left out" if m.get("eval/unscored") else ""
    print(f"{what} = {m['eval/accuracy']:.4f} [{m['eval/accuracy_ci_low']:.4f}, {m['eval/accuracy_ci_high']:.4f}] "
          f"(95 % Wilson) on {int(m['eval/problems'])} problems of {prepared.evalset.path} "
          f"({ev.accuracy_reward}{unscored}; {fmt}mean length {m['eval/response_length_mean']:.0f} tokens, truncated "
          f"{m['eval/truncated_fraction']:.2f}, {result['tokens_per_s']:.0f} tok/s, {result['seconds']:.0f} s)")
    if (warning := unscored_warning(m, f"eval.accuracy_reward {ev.accuracy_reward!r}")) is not None:
        print(f"grpo-cluster eval: warning: {warning}", file=sys.stderr)
    summary = {"model": args.model or spec.model.path, "spec": args.spec, **m, "seconds": result["seconds"],
               "tokens_per_s": result["tokens_per_s"]}
    _paired(args, baseline, result["problems"], summary)
    return _finish(args, summary, write_error)


def _cmd_eval(args) -> int:
    if (args.spec is None) == (args.data is None):
        print("grpo-cluster eval: give --spec SPEC (the spec's held-out data, prompt and scorer) or --data FILE "
              "(GSM8K jsonl), not both and not neither", file=sys.stderr)
        return 2
    if args.spec is None and args.model is None:
        print("grpo-cluster eval: --data needs --model (a model folder, builtin:<name> or hub id)", file=sys.stderr)
        return 2
    if args.spec is None and (args.set or args.imports):
        print("grpo-cluster eval: --set and --import are for --spec", file=sys.stderr)
        return 2
    return _cmd_eval_spec(args) if args.spec is not None else _cmd_eval_data(args)


def add_eval_command(sub) -> None:
    """Register ``eval`` on the ``grpo-cluster`` subcommand parser ``sub``."""
    ev = sub.add_parser("eval", help="held-out pass@1 of a model on a spec's eval set (or GSM8K rows), greedy")
    ev.add_argument("--spec", default=None, help=(
        "job spec YAML: its held-out data (eval.data_path or the source's held-out split), prompt and "
        "eval.accuracy_reward; the figures the training loop's eval/* metrics give"))
    ev.add_argument("--model", default=None, help=(
        "HF model folder (a checkpoint), builtin:<name> or hub id; with --spec default its model.path"))
    ev.add_argument("--data", default=None, help="GSM8K jsonl (question, answer), without --spec")
    ev.add_argument("--set", action="append", metavar="KEY=VALUE", help="with --spec: override a spec field")
    ev.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                    help="with --spec: import this module first, e.g. one that registers reward functions")
    ev.add_argument("--engine", choices=["vllm", "transformers"], default="vllm", help=(
        "with --spec: the vLLM engine (default) or the transformers engine (rollout.engine hf, the in-process "
        "runtime's)"))
    ev.add_argument("--limit", type=whole_number(1), default=None, metavar="N",
                    help="first N held-out rows only (with --spec: eval.limit)")
    ev.add_argument("--max-tokens", type=whole_number(1), default=None, metavar="N", help=(
        "generation cap per problem (with --spec: eval.max_tokens, default the spec's; with --data: 256)"))
    ev.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    ev.add_argument("--per-problem", metavar="FILE", help="write each problem's outcome and completion (jsonl)")
    ev.add_argument("--against", metavar="FILE", help=(
        "a --per-problem file of another model on the same problems: print gains, losses and McNemar's exact p"))
    ev.set_defaults(func=_cmd_eval)
