"""The ``pytest-opt`` command line (also ``python -m pytest_transformers_opt``).

``pytest-opt advise`` reads a model's config (no weights, nothing downloaded) and a workload, and
prints one recommended optimization with its configuration, documentation, tradeoffs, open
compatibility questions and a validation test. Bad input exits with status 2 and one line on
stderr that names the option and the accepted forms.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import NoReturn, Sequence

from .advisor import advise, advise_from_report, load_model_shape, load_report, render_json, render_text, write_test
from .advisor.change import ATTENTION_BACKENDS
from .advisor.estimates import DTYPE_FORMS, normalize_dtype
from .advisor.workload import (ASSUMED_INPUT_TOKENS, ASSUMED_MAX_NEW_TOKENS, PROBLEMS, ServingScenario,
                               parse_compute_capability)
from .errors import OptConfigError
from .units import SIZE_FORMS, parse_non_negative_int, parse_size

PROG = "pytest-opt"


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (no usage block) and exits with status 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=PROG, description="Tools of pytest-transformers-opt.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    problems = "\n".join(f"  {name:<16} {text}" for name, text in PROBLEMS.items())
    advise = commands.add_parser(
        "advise",
        help="recommend the next inference optimization for a model and workload",
        description=textwrap.fill(
            "Recommend ONE inference optimization for a model and workload, from the model's config alone (no "
            "weights, offline), following the Transformers 'Inference optimization overview' protocol. Every "
            "figure is labelled estimate, measured, stated or probed.", 79),
        epilog=f"problems (--problem):\n{problems}\n\n" + textwrap.fill(
            "Missing details are listed under 'Assumptions / questions to answer' with the assumption made. "
            "Validate the recommendation with --write-test PATH, then: pytest PATH --opt-report", 79),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = advise.add_argument_group("model")
    model.add_argument("--model", metavar="PATH",
                       help="model folder or config.json path (also a hub id already in the local cache, or the "
                            "built-in tiny-random-llama); required unless --from-report names it")
    model.add_argument("--revision", metavar="REV", help="the model revision you deploy (commit, tag or branch)")
    model.add_argument("--dtype", metavar="DTYPE",
                       help=f"dtype the model is loaded in: {DTYPE_FORMS}. Default: the config's dtype, else "
                            f"bfloat16 on a GPU (float32 on CPU)")
    model.add_argument("--attention", metavar="IMPL",
                       help=f"attention implementation your code loads today: {', '.join(ATTENTION_BACKENDS)} or a "
                            f"hub kernel id. Default: the config's, else eager (the plugin's baseline)")
    hardware = advise.add_argument_group("hardware")
    hardware.add_argument("--device", choices=("cuda", "cpu"),
                          help="where the model runs. Default: cuda (cpu for the built-in tiny models)")
    hardware.add_argument("--gpu-memory", metavar="SIZE", help=f"GPU memory available: {SIZE_FORMS}")
    hardware.add_argument("--cpu-memory", metavar="SIZE", help=f"CPU RAM available: {SIZE_FORMS}")
    hardware.add_argument("--gpu-name", metavar="NAME", help="GPU model, e.g. 'NVIDIA A100-SXM4-80GB'")
    hardware.add_argument("--compute-capability", metavar="X.Y",
                          help="GPU compute capability, e.g. 8.0 (A100) or 9.0 (H100); decides FlashAttention")
    work = advise.add_argument_group("workload")
    work.add_argument("--input-tokens", metavar="N",
                      help=f"input length in tokens. Default: assumed {ASSUMED_INPUT_TOKENS}")
    work.add_argument("--max-new-tokens", metavar="N",
                      help=f"generation limit in tokens. Default: assumed {ASSUMED_MAX_NEW_TOKENS}")
    work.add_argument("--batch-size", metavar="N", help="sequences per generate call. Default: assumed 1")
    work.add_argument("--concurrency", metavar="N", help="concurrent requests served. Default: assumed 1")
    work.add_argument("--problem", choices=tuple(PROBLEMS), metavar="PROBLEM",
                      help=f"where memory or speed breaks: {', '.join(PROBLEMS)} (see below). Default: the "
                           f"stage the estimates say breaks first")
    output = advise.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print the advice as JSON instead of text")
    output.add_argument("--write-test", metavar="PATH", help="write the validation test (a pytest file) to PATH")
    output.add_argument("--from-report", metavar="PATH",
                        help="JSON report of an earlier run (pytest --opt-report-json=PATH): its measurements "
                             "decide the next step")
    return parser


def _int(value: str | None, option: str) -> int | None:
    if value is None:
        return None
    return parse_non_negative_int(value, option, minimum=1)


def _size(value: str | None, option: str) -> int | None:
    return None if value is None else parse_size(value, option)


def workload_from_args(args: argparse.Namespace) -> ServingScenario:
    """The stated model, hardware and workload; every bad value is an ``OptConfigError`` naming its option."""
    if args.attention is not None and args.attention not in ATTENTION_BACKENDS and "/" not in args.attention:
        raise OptConfigError(f"--attention: {args.attention!r} is not an attention implementation; accepted: "
                             f"{', '.join(ATTENTION_BACKENDS)} or a hub kernel id such as "
                             f"kernels-community/flash-attn2")
    if args.compute_capability is not None:
        parse_compute_capability(args.compute_capability)
    if args.model is None and args.from_report is None:
        raise OptConfigError("--model: required (a model folder, a config.json path, or tiny-random-llama), "
                             "unless --from-report PATH is given")
    return ServingScenario(
        model=args.model,
        revision=args.revision,
        device=args.device,
        gpu_memory_bytes=_size(args.gpu_memory, "--gpu-memory"),
        cpu_memory_bytes=_size(args.cpu_memory, "--cpu-memory"),
        input_tokens=_int(args.input_tokens, "--input-tokens"),
        max_new_tokens=_int(args.max_new_tokens, "--max-new-tokens"),
        batch_size=_int(args.batch_size, "--batch-size"),
        concurrency=_int(args.concurrency, "--concurrency"),
        problem=args.problem,
        dtype=normalize_dtype(args.dtype, "--dtype") if args.dtype else None,
        attention=args.attention,
        gpu_name=args.gpu_name,
        compute_capability=args.compute_capability,
    )


def run_advise(args: argparse.Namespace) -> int:
    workload = workload_from_args(args)
    if args.from_report:
        report = load_report(args.from_report)
        # A --model given explicitly must be readable, even though the report could name one.
        config = load_model_shape(args.model, args.revision) if args.model else None
        advice = advise_from_report(report, workload, config=config, source=args.from_report)
    else:
        advice = advise(workload)
    if args.write_test:
        if advice.test is None or not advice.configuration:
            raise OptConfigError(f"--write-test: nothing new to validate ({advice.title})")
        try:
            write_test(advice, args.write_test)
        except OSError as exc:
            raise OptConfigError(f"--write-test: cannot write {args.write_test}: {exc.strerror or exc}") from None
    sys.stdout.write(render_json(advice, args.write_test) if args.json else render_text(advice, args.write_test))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pytest-opt``; returns the exit status (0 ok, 2 bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error already reported (2)
        return int(exc.code) if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return run_advise(args)
    except OptConfigError as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message held
        sys.stderr.write(f"{PROG} advise: error: {message}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
