"""The ``pytest-opt`` command line (also ``python -m pytest_transformers_opt``).

``pytest-opt advise`` reads a model's config (no weights, nothing downloaded) and a workload, and
prints one recommended optimization with its configuration, documentation, tradeoffs, open
compatibility questions and a validation test. ``pytest-opt merge`` joins the JSON reports of many
shards into one, and can gate it against an earlier report as ``--opt-compare-fail`` does (exit 1 on
a regression). ``pytest-opt history`` finds and dates the change points of a folder written by
``--opt-history`` (or writes it as Otava's CSV). ``pytest-opt init`` writes a starter test file, the
plugin's settings and the GPU gate workflow into a project (``scaffold``). Bad input exits with status 2
and one line on stderr that names the option (or the file) and the accepted forms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence

from .advisor import advise, advise_from_report, load_model_shape, load_report, render_json, render_text, write_test
from .advisor.change import ATTENTION_BACKENDS
from .advisor.estimates import DTYPE_FORMS, normalize_dtype
from .advisor.workload import (ASSUMED_INPUT_TOKENS, ASSUMED_MAX_NEW_TOKENS, PROBLEMS, ServingScenario,
                               parse_compute_capability)
from .errors import OptConfigError
from .files import write_atomic
from .units import SIZE_FORMS, parse_non_negative_int, parse_size
from .verdict.stats import DEFAULT_COMPARE_WINDOW, MAX_COMPARE_WINDOW, MIN_WINDOW_RUNS, compare_window_size

if TYPE_CHECKING:
    from .verdict.compare import Threshold

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
                       help="model folder or config.json path (also a hub id already in the local cache, or a "
                            "built-in model: tiny-random-llama, smollm2-135m, ...); required unless --from-report "
                            "names it")
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
    _add_merge(commands)
    _add_history(commands)
    _add_init(commands)
    return parser


def _add_init(commands: Any) -> None:
    init = commands.add_parser(
        "init",
        help="write a starter test file, the plugin's settings and the GPU gate workflow into a project",
        description=textwrap.fill(
            "Write into the project's folder: tests/test_optimizations.py (one test for each of the 3 changes the "
            "advisor picks for the model, budgets not yet measured left as comments), the plugin's settings (a "
            "[tool.pytest.ini_options] table appended to pyproject.toml in its own line endings, else a "
            "pytest.ini), .github/workflows/gpu-gate.yml (the GPU gate: main's runs recorded in the Actions "
            "cache, each pull request judged against their window) and, when the project has no actionlint "
            "configuration, .github/actionlint.yaml naming the runner's label. Then run pytest there.", 79),
        epilog=textwrap.fill(
            "Exit status: 0 written; 1 refused: a target exists, pytest settings exist elsewhere (pytest.ini, "
            "pyproject.toml's [tool.pytest] or [tool.pytest.ini_options], tox.ini, setup.cfg), or pyproject.toml "
            "is not valid TOML (each named on stderr), and nothing was written; 2 bad usage (one line naming the "
            "option and the accepted forms).", 79),
    )
    init.add_argument("--model", metavar="NAME",
                      help="the model the tests load: a built-in model (default tiny-random-llama), a model folder "
                           "with config.json, or a hub id in the local cache")
    init.add_argument("--gpu-memory", metavar="SIZE",
                      help=f"GPU memory the model may use, for the advisor's picks and max_memory budgets: "
                           f"{SIZE_FORMS}")
    init.add_argument("--directory", metavar="DIR", default=".",
                      help="the project's folder (created when missing). Default: the current folder")
    init.add_argument("--dry-run", action="store_true", help="print each path and its content; write nothing")


def run_init(args: argparse.Namespace) -> int:
    from .scaffold import init_project  # lazy: the other commands never need it

    return init_project(args.model, _size(args.gpu_memory, "--gpu-memory"), args.directory, args.dry_run)


def _add_merge(commands: Any) -> None:
    merge = commands.add_parser(
        "merge",
        help="merge the JSON reports of several shards into one report, optionally gated against an earlier one",
        description=textwrap.fill(
            "Merge JSON reports (pytest --opt-report-json=PATH) of shards of one suite (CI jobs, machines, GPU "
            "types) into one report. Tests are keyed by (node id, hardware): the same test on two GPU types stays "
            "two rows; the same test twice on the same hardware is an error naming both files. Each shard's "
            "environment and settings are kept under \"shards\".", 79),
        epilog=textwrap.fill(
            "Exit status: 0 merged (and, with --compare-fail, nothing regressed); 1 a test regressed past "
            "--compare-fail, or it judged no test (every row new or not comparable); 2 bad input (one line naming "
            "the file or option), or an output that could not be written (the others are).", 79),
    )
    merge.add_argument("reports", nargs="+", metavar="REPORT.json", help="the shards' JSON reports")
    merge.add_argument("-o", "--output", required=True, metavar="MERGED.json", help="where to write the merged report")
    merge.add_argument("--md", metavar="PATH", help="also render the merged report as Markdown to PATH")
    merge.add_argument("--html", metavar="PATH", help="also render the merged report as HTML to PATH")
    merge.add_argument("--compare", metavar="OLD.json|DIR",
                       help="compare the merged report with an earlier report (one run's or a merged one), or with "
                            "each test's window of runs in a folder written by pytest --opt-history, as pytest "
                            "--opt-compare does; the verdicts go into the merged report")
    merge.add_argument("--compare-window", metavar="N", type=_window_size,
                       help=f"with --compare DIR: each test's last N recorded runs on its hardware and stack "
                            f"(default {DEFAULT_COMPARE_WINDOW}; {MIN_WINDOW_RUNS} to {MAX_COMPARE_WINDOW})")
    merge.add_argument("--compare-fail", metavar="SPEC",
                       help="with --compare: exit 1 when a test regressed past these thresholds, as pytest "
                            "--opt-compare-fail does, e.g. latency:10%%,peak_memory:5%%,kl_mean:0.01")


HISTORY_METRICS = ("latency", "peak_memory", "kl_mean", "speedup")  # report.changepoints.METRICS, not imported here
DEFAULT_HISTORY_RUNS = 200
_QUIET_RUNS = 40  # runs read in a second or two, silently (a report of 20 tests: about 25 ms to read and check)
_OTAVA_YAML = """\
  tests:
    sdpa:
      type: csv
      file: sdpa.csv
      time_column: time
      attributes: [commit, test, hardware, model, dtype, techniques, workload]
      metrics:
        latency: {direction: -1}      # lower is better
        peak_memory: {direction: -1}
        kl_mean: {direction: -1}
        speedup: {direction: 1}       # higher is better"""


def _add_history(commands: Any) -> None:
    history = commands.add_parser(
        "history",
        help="the change points of a recorded history (pytest --opt-history=DIR), dated by run and commit",
        description=textwrap.fill(
            "Find where each test's figures moved in a history folder written by pytest --opt-history=DIR. A "
            "series is one test on one hardware with one model (name, revision, dtype, arguments), techniques "
            "and workload: runs of another model under the same test id are another series, named on its own "
            "line. Per series and figure: each change point's first run after the change (its time and commit, "
            "and the commit range since the run before), its size (the ratio of the medians after and before, "
            "with a 95% bootstrap interval) and how sure it is (a p-value). Change points are proposed by "
            "ruptures (binary segmentation) and kept at p <= 0.001 by a t-test of the split (as Apache Otava's) "
            "or a permutation test of the ranks. A change needs 3 runs on each side, so a series needs 6 runs. "
            "Found at its run in 95% of seeded histories: +60% among 2-3% run-to-run noise from 6 runs (among "
            "5%, 8); +20% among 2% from 8 runs, among 3% from 12; +10% among 2% from 31 (benchmarks/RESULTS.md). "
            "The last run against its reference is pytest --opt-compare's job. Needs the history extra: pip install \"pytest-transformers-opt[history]\".", 79),
        epilog="\n\n".join([
            textwrap.fill(
                "Figures (--metric): latency is optimized.latency_s (seconds), peak_memory "
                "optimized.peak_memory_bytes (bytes), kl_mean similarity.kl_mean, speedup the speedup over the "
                "baseline. A run where a figure is missing or not finite is left out of that figure's series.", 79),
            textwrap.fill(
                "--format otava-csv writes one series' runs as Apache Otava's CSV importer reads them: a header "
                "time,commit,test,hardware,model,revision,dtype,model_arguments,techniques,baseline,workload,"
                "<figure>..., one row per run, oldest first, the time in ISO 8601 with its zone (UTC); the "
                "columns after commit name the series (the same on every row). Otava reads one series per CSV "
                "file, so --test (with --hardware and --series where the test has several series) must select "
                "exactly one; and since Otava converts every figure cell to a number, a run missing one of the "
                "figures written is left out (choose them with --metric). An otava.yaml for it:", 79)
            + "\n" + _OTAVA_YAML,
            textwrap.fill(
                "Exit status: 0 the history was read (this command reports, it does not gate: use pytest "
                "--opt-compare=DIR for that); 2 bad usage, a missing folder or one with no readable recorded "
                "run, or ruptures not installed (one line). Each file of the folder that cannot be read is "
                "named on stderr, one line each ('left out: NAME: why'), and the rest is analysed.", 79),
        ]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    history.add_argument("folder", metavar="DIR", help="the history folder (pytest --opt-history=DIR)")
    history.add_argument("--test", metavar="EXPR",
                         help="only tests whose node id contains EXPR (a plain substring, not a -k expression); a "
                              "full node id selects that test alone")
    history.add_argument("--hardware", metavar="TEXT",
                         help="only tests run on hardware whose fingerprint contains TEXT (e.g. H100, or CPU)")
    history.add_argument("--series", metavar="TEXT",
                         help="only series whose name (model, dtype, techniques and workload, as the output names "
                              "each) contains TEXT (e.g. tiny-random-gpt2, or bfloat16)")
    history.add_argument("--metric", action="append", choices=HISTORY_METRICS, metavar="NAME",
                         help=f"the figure to follow: {', '.join(HISTORY_METRICS)}; repeat for several. "
                              f"Default: all four")
    history.add_argument("--format", choices=("text", "json", "otava-csv"), default=None, dest="output_format",
                         help="text (default): one line per change point, or per series without one; json: every "
                              "series with its values and change points; otava-csv: see below")
    history.add_argument("--json", action="store_true", help="the same as --format json")
    history.add_argument("--limit", metavar="N", default=str(DEFAULT_HISTORY_RUNS),
                         help=f"read the newest N recorded runs. Default: {DEFAULT_HISTORY_RUNS}")


def _history_format(args: argparse.Namespace) -> str:
    if args.json and args.output_format not in (None, "json"):
        raise OptConfigError(f"--json and --format {args.output_format}: choose one output")
    return "json" if args.json else (args.output_format or "text")


def run_history(args: argparse.Namespace) -> int:
    # Lazy: the report stage is not needed by advise, and the detection's numpy and ruptures load on use.
    from .report import changepoints
    from .report.history import load_history, run_names

    output = _history_format(args)
    limit = _int(args.limit, "--limit") or DEFAULT_HISTORY_RUNS
    if output != "otava-csv":  # the CSV needs no detection: it works without the extra
        changepoints.require_ruptures()
    folder = Path(args.folder).expanduser()
    accepted = "give the folder pytest --opt-history=DIR records its runs in"
    if not folder.exists():
        raise OptConfigError(f"{args.folder!r} does not exist; {accepted}")
    if not folder.is_dir():
        raise OptConfigError(f"{args.folder!r} is not a folder; {accepted}")
    recorded = len(run_names(folder))
    if not recorded:
        raise OptConfigError(f"{args.folder!r} holds no recorded run (files named like 20261201T131500Z-1a2b3c4.json); "
                             f"{accepted}")
    slow = min(recorded, limit) > _QUIET_RUNS
    if slow:  # on stderr: stdout holds the JSON or the CSV alone
        sys.stderr.write(f"reading {min(recorded, limit)} recorded runs in {args.folder} ...\n")
    began = time.perf_counter()
    history = load_history(folder, limit)
    for why in history.left_out:
        sys.stderr.write(f"left out: {' '.join(why.split())}\n")
    if not history.runs:
        count = len(history.left_out)
        raise OptConfigError(f"none of the {count} recorded run{'s' if count != 1 else ''} read in {args.folder!r} "
                             f"could be used (each is named above)")
    tracks = changepoints.select_tracks(changepoints.tracked_tests(history), test=args.test, hardware=args.hardware,
                                        series=args.series)
    filters = (("--test", args.test), ("--hardware", args.hardware), ("--series", args.series))
    if not tracks and any(value is not None for _, value in filters):
        chosen = " and ".join(f"{option} {value!r}" for option, value in filters if value is not None)
        raise OptConfigError(f"{chosen}: no measured test of the {len(history.runs)} runs read matches")
    if not tracks and output == "otava-csv":
        raise OptConfigError(f"--format otava-csv: no measured test in the {len(history.runs)} runs read")
    metrics = args.metric or list(HISTORY_METRICS)
    if output == "otava-csv":
        if len(tracks) != 1:
            names = "; ".join(track.label for track in tracks[:4]) + ("; ..." if len(tracks) > 4 else "")
            raise OptConfigError(f"--format otava-csv: Otava reads one series per CSV file and {len(tracks)} series "
                                 f"match ({names}); select one with --test (and --hardware, --series)")
        sys.stdout.write(changepoints.otava_csv(tracks[0], metrics))
        return 0
    first, last = history.runs[0].name, history.runs[-1].name
    span = f"{first.name} .. {last.name}" if first and last else ""
    if output == "json":
        series = [changepoints.to_json(analysis) for track in tracks
                  for analysis in changepoints.analyse_track(track, metrics)]
        if slow:
            sys.stderr.write(f"read {len(history.runs)} runs and analysed {len(series)} series in "
                             f"{time.perf_counter() - began:.1f} s\n")
        document = {"folder": history.folder, "runs_read": len(history.runs), "left_out": history.left_out,
                    "method": changepoints.method_json(), "series": series}
        sys.stdout.write(json.dumps(document, indent=1, allow_nan=False) + "\n")
        return 0
    runs = len(history.runs)
    tests = len({track.nodeid for track in tracks})
    print(f"history {history.folder}: {runs} run{'s' if runs != 1 else ''} read ({span}), {len(tracks)} "
          f"series of {tests} test{'s' if tests != 1 else ''} (a series: one hardware, model, techniques and "
          f"workload)", flush=True)
    found = analysed = 0
    for track in tracks:  # lines per series as it is analysed: a long history shows progress
        print(changepoints.heading(track), flush=True)
        for analysis in changepoints.analyse_track(track, metrics):
            analysed += 1
            found += len(analysis.change_points)
            print("\n".join(f"  {line}" for line in changepoints.describe(analysis)), flush=True)
    print(f"{found} change point{'s' if found != 1 else ''} in {analysed} figure{'s' if analysed != 1 else ''} of "
          f"{len(tracks)} series")
    return 0


def _window_size(value: str) -> int:
    """--compare-window, as pytest's --opt-compare-window reads it (argparse turns the error into one line)."""
    try:
        return compare_window_size(value)
    except OptConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
        raise OptConfigError("--model: required (a model folder, a config.json path, or a built-in model such as "
                             "tiny-random-llama or smollm2-135m), "
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


def _writable(path: str, option: str) -> None:
    """Refuse an output path that cannot be written before any report is read."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise OptConfigError(f"{option}: {path!r} is a folder; give a file path")
    if not target.resolve().parent.is_dir():
        raise OptConfigError(f"{option}: the folder of {path!r} does not exist; create it or choose another path")


def _write(path: str, option: str, text: str) -> None:
    try:
        write_atomic(path, text)
    except OSError as exc:
        raise OptConfigError(f"{option}: cannot write {path!r}: {exc.strerror or exc}") from None


def _distinct_paths(args: argparse.Namespace) -> None:
    """No two outputs name the same file, and no rendering replaces a report this command reads."""
    written: dict[Path, str] = {}
    for path, option in ((args.output, "-o"), (args.md, "--md"), (args.html, "--html")):
        if path is None:
            continue
        same = Path(path).expanduser().resolve()
        if same in written:
            raise OptConfigError(f"{written[same]} and {option} name the same file {path!r}; each output needs its "
                                 f"own path")
        written[same] = option
    read = [(path, "an input report") for path in args.reports]
    if args.compare is not None:
        read.append((args.compare, "the --compare report"))
    for path, what in read:
        renders = written.get(Path(path).expanduser().resolve())
        if renders in ("--md", "--html"):
            raise OptConfigError(f"{renders}: {path!r} is {what}; rendering there would replace it: give another path")


def _merge_verdicts(args: argparse.Namespace, merged: dict[str, Any], old: dict[str, Any] | None,
                    thresholds: list["Threshold"]) -> tuple[list[str], str | None]:
    """--compare: the verdicts written into ``merged``, the terminal lines, and why the gate fails (None: it
    passes, or there is no gate)."""
    from .report.compare import summarise
    from .verdict.compare import attach_verdicts, compare_reports, nothing_judged

    first_run = False
    if old is not None:
        verdicts = compare_reports(old, merged, thresholds)
        lines = summarise(verdicts, args.compare, old)
    elif args.compare is not None:  # a folder of runs recorded by --opt-history: each test against its window
        from .report.window import compare_with_window

        window = compare_with_window(args.compare, merged, thresholds, args.compare_window, confirm=bool(thresholds))
        verdicts, lines, first_run = window.verdicts, window.lines, window.empty
    else:
        return [], None
    attach_verdicts(merged, verdicts)
    if not thresholds or first_run:  # the first run of a history has nothing to be judged against: not a failure
        return lines, None
    gate = f"--compare-fail={args.compare_fail} against --compare={args.compare}"
    regressed = sum(v.get("verdict") == "regressed" for v in verdicts.values())
    if regressed:
        return lines, f"{regressed} test{'s' if regressed != 1 else ''} regressed past {gate}"
    unjudged = nothing_judged(verdicts)  # a gate that judged nothing does not pass
    return lines, None if unjudged is None else f"{gate}: {unjudged}"


def run_merge(args: argparse.Namespace) -> int:
    # Lazy: the report stage is not needed by advise.
    from .report.compare import load_compare_report
    from .verdict.compare import parse_compare_fail
    from .report.merge import load_shards, merge_reports
    from .report.schema import report_text

    if args.compare_fail is not None and args.compare is None:
        raise OptConfigError("--compare-fail: needs --compare OLD.json (the earlier report)")
    thresholds = parse_compare_fail(args.compare_fail, "--compare-fail") if args.compare_fail is not None else []
    for path, option in ((args.output, "-o"), (args.md, "--md"), (args.html, "--html")):
        if path is not None:
            _writable(path, option)
    _distinct_paths(args)
    if args.compare_window is not None and (args.compare is None or not os.path.isdir(args.compare)):
        raise OptConfigError(f"--compare-window: needs --compare DIR, a folder of runs recorded by pytest "
                             f"--opt-history (found: {'--compare ' + args.compare if args.compare else 'no --compare'})")
    args.compare_window = args.compare_window or DEFAULT_COMPARE_WINDOW
    old = load_compare_report(args.compare, "--compare") \
        if args.compare is not None and not os.path.isdir(args.compare) else None
    count = len(args.reports)
    print(f"merging {count} report{'s' if count != 1 else ''} into {args.output} ...", flush=True)
    notes: list[str] = []  # what the reader ignored in reports written by another version of the plugin
    merged = merge_reports(load_shards(args.reports, notes))
    for note in notes:
        print(f"note: {note}")
    lines, gate_failure = _merge_verdicts(args, merged, old, thresholds)
    # Each output on its own: one that cannot be written costs only itself (as pytest's session end does).
    outputs: list[tuple[str, str, Callable[[], str]]] = [("-o", args.output, lambda: report_text(merged))]
    if args.md is not None:
        from .report.markdown import render_markdown

        outputs.append(("--md", args.md, lambda: render_markdown(merged)))
    if args.html is not None:
        from .report.html import render_html

        outputs.append(("--html", args.html, lambda: render_html(merged)))
    problems: dict[str, str] = {}  # option -> why its file was not written
    for option, path, render in outputs:
        try:
            _write(path, option, render())
        except OptConfigError as exc:
            problems[option] = " ".join(str(exc).split())
        except ValueError as exc:  # a report its readers would refuse (report_text): refused before writing
            problems[option] = f"{option}: cannot write {path!r}: {exc}"
    for line in lines:
        print(line)
    if "-o" not in problems:
        shards = len(merged["shards"])
        print(f"wrote {args.output} ({len(merged['tests'])} tests from {shards} shard{'s' if shards != 1 else ''})")
    for problem in problems.values():
        sys.stderr.write(f"{PROG} merge: error: {problem}\n")
    if gate_failure is not None:
        sys.stderr.write(f"{PROG} merge: {gate_failure}: exit status 1\n")
        return 1
    return 2 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pytest-opt``; returns the exit status (0 ok, 1 merge: a regression, 2 bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error already reported (2)
        return int(exc.code) if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        commands = {"merge": run_merge, "history": run_history, "advise": run_advise, "init": run_init}
        return commands[args.command](args)
    except OptConfigError as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message held
        sys.stderr.write(f"{PROG} {args.command}: error: {message}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
