"""The ``hostreduce`` command line: ``hostreduce run -np N [--] COMMAND ...``."""
from __future__ import annotations

import argparse
import math
import sys
from typing import Callable, Sequence

from .runner import GRACE_PERIOD_S, run_workers

__all__ = ["main", "build_parser"]

_USAGE_EXIT_CODE = 2


def _num_workers(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1. Received: -np {raw!r}")
    return value


def _positive_seconds(option: str) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not value > 0 or math.isinf(value):
            raise argparse.ArgumentTypeError(f"must be a number of seconds > 0. Received: {option} {raw!r}")
        return value

    return parse


def _grace_seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0. Received: --grace-period {raw!r}")
    return value


def _version() -> str:
    from ..version import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hostreduce",
        description="Host-offloaded gradient reduction for TensorFlow data-parallel training.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
    commands.required = True
    run = commands.add_parser(
        "run",
        help="start N local workers of one job",
        description=(
            "Start N local workers running COMMAND. Each gets TF_CONFIG for a cluster of "
            "loopback addresses and a shared HOSTREDUCE_SECRET (a fresh random one unless "
            "HOSTREDUCE_SECRET is already set); without --ps or --evaluator, also the "
            "HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE, "
            "HOROVOD_CROSS_RANK and HOROVOD_CROSS_SIZE that horovodrun would set. "
            "Output lines are prefixed with '[rank] '. "
            "When a worker fails, all others are stopped and its exit code is returned."
        ),
        usage="hostreduce run -np N [options] [--] COMMAND [ARGS ...]",
    )
    run.add_argument("-np", "--num-workers", dest="num_workers", type=_num_workers, required=True,
                     metavar="N", help="number of workers to start (>= 1)")
    run.add_argument("--ps", dest="num_ps", type=_num_workers, default=0, metavar="M",
                     help="also start M parameter-server tasks (ParameterServerStrategy; worker 0 is the chief)")
    run.add_argument("--evaluator", action="store_true",
                     help="also start an evaluator task (it evaluates each checkpoint of a ps job)")
    run.add_argument("--host", default="127.0.0.1",
                     help="address used for the workers' cluster addresses (default: %(default)s)")
    run.add_argument("--timeout", type=_positive_seconds("--timeout"), default=None, metavar="SECONDS",
                     help="stop every worker and exit with 124 after this many seconds")
    run.add_argument("--grace-period", type=_grace_seconds, default=GRACE_PERIOD_S, metavar="SECONDS",
                     help="seconds between SIGTERM and SIGKILL when stopping workers (default: %(default)s)")
    run.add_argument("--no-prefix", dest="prefix", action="store_false",
                     help="do not prefix output lines with '[rank] ' (output is then passed through untouched)")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="keep TensorFlow's start-up notices (no CUDA driver, cuInit, CPU instructions, oneDNN), "
                          "which are dropped from the workers' output otherwise")
    elastic = run.add_argument_group(
        "elastic jobs", "Workers may fail or join while the job runs (hostreduce.horovod.elastic); any of these "
        "options makes the job elastic (docs/guides/elastic.md)")
    elastic.add_argument("--min-np", dest="min_np", type=_num_workers, default=None, metavar="A",
                         help="the fewest workers the job goes on with (default: -np)")
    elastic.add_argument("--max-np", dest="max_np", type=_num_workers, default=None, metavar="B",
                         help="the most workers the job runs at once (default: -np without a discovery script, "
                              "else no limit)")
    elastic.add_argument("--host-discovery-script", dest="discovery_script", default=None, metavar="SCRIPT",
                         help="executable printing the hosts the job may use, `host:slots` per line; run every "
                              "second, new workers start on free slots of this machine")
    elastic.add_argument("--reset-limit", dest="reset_limit", type=int, default=None, metavar="R",
                         help="fail the job after more than R resets (default: no limit)")
    elastic.add_argument("--elastic-timeout", dest="elastic_timeout", type=_positive_seconds("--elastic-timeout"),
                         default=None, metavar="SECONDS",
                         help="how long the job waits for --min-np workers, and for every worker at a rendezvous "
                              "(default: 600)")
    elastic.add_argument("--ssh-command", dest="ssh_command", default=None, metavar="AGENT",
                         help="how workers start on other hosts of the discovery script: AGENT HOST COMMAND "
                              "(default: 'ssh -o BatchMode=yes'; they must reach --host)")
    elastic.add_argument("--blacklist-after", dest="blacklist_after", type=_num_workers, default=None, metavar="K",
                         help="start no new worker on a host whose workers failed K times (default: 3)")
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND",
                     help="program and arguments each worker runs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hostreduce`` program; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        sys.stderr.write("hostreduce run: error: COMMAND is required. Received: no command after the options\n")
        return _USAGE_EXIT_CODE
    elastic = [f for f in ("min_np", "max_np", "discovery_script", "reset_limit", "elastic_timeout", "blacklist_after",
                           "ssh_command")
               if getattr(args, f) is not None]
    try:
        if elastic:
            if args.num_ps or args.evaluator:
                raise ValueError("--ps and --evaluator cannot be combined with the elastic options. Received: "
                                 + ", ".join("--" + f.replace("_", "-") for f in elastic))
            from .elastic import BLACKLIST_AFTER, ELASTIC_TIMEOUT_S, SSH_COMMAND, run_elastic

            max_np = args.max_np or (sys.maxsize if args.discovery_script else args.num_workers)
            return run_elastic(
                command,
                args.num_workers,
                min_np=args.min_np or args.num_workers,
                max_np=max_np,
                discovery_script=args.discovery_script,
                reset_limit=args.reset_limit,
                elastic_timeout=args.elastic_timeout or ELASTIC_TIMEOUT_S,
                blacklist_after=args.blacklist_after or BLACKLIST_AFTER,
                ssh_command=args.ssh_command or SSH_COMMAND,
                timeout=args.timeout,
                prefix=args.prefix,
                host=args.host,
                grace_period=args.grace_period,
                verbose=args.verbose,
            )
        return run_workers(
            command,
            args.num_workers,
            timeout=args.timeout,
            prefix=args.prefix,
            host=args.host,
            grace_period=args.grace_period,
            verbose=args.verbose,
            num_ps=args.num_ps,
            evaluator=args.evaluator,
        )
    except ValueError as exc:
        sys.stderr.write(f"hostreduce run: error: {exc}\n")
        return _USAGE_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
