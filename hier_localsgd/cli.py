"""The ``hier-localsgd`` command.

    hier-localsgd lighthouse [overrides...]   serve the global and/or cluster lighthouses
    hier-localsgd train      [overrides...]   run one replica group (run.cluster, run.replica)
    hier-localsgd demo       [overrides...]   a whole job on this machine, with a summary
    hier-localsgd dashboard  [overrides...]   the live page of a run directory
    hier-localsgd chaos      [overrides...]   the same while killing processes; a recovery report
    hier-localsgd sweep      [overrides...]   lossy slow links: final loss vs loss rate per mode
    hier-localsgd tp-sweep   [overrides...]   lossy tensor parallelism: loss rate x model x TP operation
    hier-localsgd bench      [overrides...]   ddp vs flat vs hier on emulated LAN/WAN links
    hier-localsgd plan       [overrides...]   cost planner: params, FLOPs, memory, sync time per level
    hier-localsgd simulate   [overrides...]   scale simulator: goodput under failures

Overrides are hydra syntax (``topology.clusters=3 model=tiny``); see configs/.
A configuration error (a bad data file included) exits with code 2 and one line
naming the field, before any process starts. ``train`` on a terminal or pipe prints
one line per log record and writes its full log, tracebacks included, to
``<run.dir>/logs/<tag>.log``; ``HIER_LOCALSGD_DEBUG=1`` prints tracebacks on the
console too.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

from hier_localsgd.core.runtime.logs import debug, setup_logging
from hier_localsgd.core.runtime.runtime import EXIT_CONFIG

if TYPE_CHECKING:
    from hier_localsgd.config import Config

logger = logging.getLogger("hier_localsgd.cli")

COMMANDS = {
    "lighthouse": "serve the global and/or per-cluster lighthouses (lighthouse.serve=all|global|cluster)",
    "train": "run one replica group: run.cluster=C run.replica=R",
    "demo": "start lighthouses and every replica group on this machine, train, summarize",
    "dashboard": "serve the live dashboard of a run directory (dashboard.run_dir, default run.dir)",
    "chaos": "like demo, while SIGKILLing processes on a seeded schedule; report the recovery",
    "sweep": "loss rates x loss models x fills x modes on the slow links: table and plot of final loss",
    "tp-sweep": "lossy tensor parallelism: final loss per loss rate x loss model x TP operation (tp_sweep.*)",
    "bench": "ddp vs flat DiLoCo vs hier on emulated LAN/WAN: bytes, time to target, sync time vs bound",
    "plan": "predict parameters, FLOPs, memory and sync time per level; compute-optimal N and D (topology, sync, links, train, plan.*)",
    "tunnel": "this host's end of the WireGuard mesh across the WAN (tunnel.site, tunnel.sites; docs/security.md)",
    "simulate": "discrete-event simulation of a deployment with failures: goodput (topology, sync, links, timeouts, plan.*, simulate.*)",
}

KEYGEN = "write a fresh job secret to PATH (security.secret_file; docs/security.md)"


def _keygen(path: str) -> int:
    from hier_localsgd.core.security.secret import keygen
    from hier_localsgd.errors import ConfigError

    try:
        keygen(path)
    except ConfigError as e:
        print(f"hier-localsgd keygen: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"wrote a job secret to {path} (mode 0600): every process of the job reads it (security.secret_file={path})")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    # torchft's Rust logger reads RUST_LOG at import; its INFO level is very chatty.
    os.environ.setdefault("RUST_LOG", "warn")
    parser = argparse.ArgumentParser(prog="hier-localsgd", description="Fault-tolerant hierarchical LocalSGD/DiLoCo on torchft.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join([*COMMANDS, "keygen"]) + "}")
    for name, text in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("overrides", nargs="*", help="hydra overrides, e.g. topology.clusters=3 model=tiny")
        p.add_argument("--print-config", action="store_true", help="print the composed config and exit")
    kg = sub.add_parser("keygen", help=KEYGEN, description=KEYGEN)
    kg.add_argument("path", help="the file to write (mode 0600; an existing file is never overwritten)")
    args = parser.parse_args(argv)
    if args.command == "keygen":
        return _keygen(args.path)

    if args.command == "train":
        # Before any other thread exists: signals go to the runtime's signal thread.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
    elif args.command in STOPPABLE:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _stop_on_signal)

    from hier_localsgd.config import ConfigError, dump, load_config

    try:
        cfg = load_config(args.overrides, validate_for=args.command)
    except ConfigError as e:
        if debug():
            traceback.print_exc()
        print(f"hier-localsgd {args.command}: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.print_config:
        print(dump(cfg))
        return 0
    if args.command in WRITES_RUN_DIR:
        problem = _make_run_dir(cfg.run.dir)
        if problem is not None:
            print(f"hier-localsgd {args.command}: configuration error: run.dir: {problem}", file=sys.stderr)
            return EXIT_CONFIG

    if args.command != "train":  # train logs under its replica tag (_train)
        setup_logging(cfg.run.log_level, args.command)
    try:
        return HANDLERS[args.command](cfg, args.overrides)
    except Stopped as e:
        print(f"hier-localsgd {args.command}: stopped by {e.signame}; its processes were stopped and its network "
              f"namespaces removed (run directory {cfg.run.dir})", file=sys.stderr)
        return 128 + e.signum
    except ConfigError as e:  # found by a command before it starts anything (bench: an arm the workload cannot run)
        if debug():
            traceback.print_exc()
        print(f"hier-localsgd {args.command}: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG


# Commands that write under run.dir (logs, status, results, reports): it is made before
# anything starts, and a path that cannot be a directory is one configuration error.
WRITES_RUN_DIR = ("train", "demo", "chaos", "sweep", "tp-sweep", "bench", "plan", "simulate", "tunnel")


def _make_run_dir(path: str) -> Optional[str]:
    """Makes ``path`` (and its parents); what is wrong with it, in words, or None."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        return f"{path!r} is a file, not a directory"
    except NotADirectoryError:
        return f"{path!r}: a part of it is a file, not a directory"
    except OSError as e:
        return f"cannot create {path!r}: {e.strerror or e}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"cannot write in {path!r} (permission denied)"
    return None


# Commands that start processes (and network namespaces) of their own: SIGTERM or SIGHUP
# stops them as Ctrl-C does, through their ``finally`` blocks (LocalJob.stop: every
# process it started, the namespaces it made), instead of leaving them running. train
# handles its signals on its own thread; lighthouse waits for them (launch/lighthouse.py).
STOPPABLE = ("demo", "chaos", "sweep", "tp-sweep", "bench", "dashboard")


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP in a STOPPABLE command (a KeyboardInterrupt, so the code that
    cleans up after Ctrl-C cleans up after it too)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.signame = signal.Signals(signum).name
        super().__init__(self.signame)


def _stop_on_signal(signum: int, frame: object) -> None:
    # A second signal must not interrupt the clean-up the first one started (it is bounded:
    # LocalJob.stop waits at most its grace, then SIGKILLs).
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


# -- one handler per command: (config, overrides) -> exit code; imports are lazy so that
# a light command (plan) does not import torch.distributed or torchft.


def _lighthouse(cfg: "Config", overrides: List[str]) -> int:
    from hier_localsgd.launch import lighthouse

    return lighthouse.serve(cfg)


def _tunnel(cfg: "Config") -> int:
    import threading

    from hier_localsgd.core.security.secret import load_secret
    from hier_localsgd.launch.tunnel import TunnelError, serve

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        return serve(cfg.tunnel, load_secret(cfg.security), stop, Path(cfg.run.dir) / "wireguard.log", mtu=cfg.security.tunnel_mtu)
    except TunnelError as e:
        print(f"hier-localsgd tunnel: {e}", file=sys.stderr)
        return 1


def _demo(cfg: "Config", overrides: List[str]) -> int:
    from hier_localsgd.experiments.demo import run_demo

    return run_demo(cfg, overrides)


def _tool(command: str, cfg: "Config") -> int:
    """plan and simulate: a ValueError from the model is a configuration error (its message
    starts with the field, e.g. plan.model.dim)."""
    out = os.path.join(cfg.run.dir, command)
    try:
        if command == "plan":
            from hier_localsgd.tools.plan.report import run_plan

            return run_plan(cfg, out)
        from hier_localsgd.tools.simulate.report import run_simulate

        return run_simulate(cfg, out)
    except ValueError as e:
        print(f"hier-localsgd {command}: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG


def _dashboard(cfg: "Config", overrides: List[str]) -> int:
    from hier_localsgd.tools.dashboard.server import serve

    if not cfg.dashboard.run_dir:
        cfg.dashboard.run_dir = cfg.run.dir
    return serve(cfg.dashboard)


def _chaos(cfg: "Config", overrides: List[str]) -> int:
    from hier_localsgd.experiments.chaos import run_chaos

    return run_chaos(cfg, overrides)


def _sweep(cfg: "Config", overrides: List[str]) -> int:
    from hier_localsgd.experiments.sweep import run_sweep

    return run_sweep(cfg, overrides)


def _tp_sweep(cfg: "Config", overrides: List[str]) -> int:
    from hier_localsgd.experiments.tp_sweep import run_tp_sweep

    return run_tp_sweep(cfg, overrides)


def _bench(cfg: "Config", overrides: List[str]) -> int:
    if cfg.bench.sweep_gbps:  # the sweep over WAN rates, arms and seeds
        from hier_localsgd.experiments.bench_sweep import run_sweep

        return run_sweep(cfg, overrides)
    from hier_localsgd.experiments.bench import run_bench

    return run_bench(cfg, overrides)


def _train(cfg: "Config", overrides: List[str]) -> int:
    """One replica group (or one rank of it): the built-in loop (train/trainer.py) under
    :func:`hier_localsgd.run`, which ends the process."""
    from hier_localsgd.job import run
    from hier_localsgd.train.trainer import train

    run(train, cfg)
    return 0  # not reached: run() exits the process


HANDLERS: Dict[str, Callable[["Config", List[str]], int]] = {
    "lighthouse": _lighthouse,
    "train": _train,
    "demo": _demo,
    "dashboard": _dashboard,
    "chaos": _chaos,
    "sweep": _sweep,
    "tp-sweep": _tp_sweep,
    "bench": _bench,
    "plan": lambda cfg, overrides: _tool("plan", cfg),
    "simulate": lambda cfg, overrides: _tool("simulate", cfg),
    "tunnel": lambda cfg, overrides: _tunnel(cfg),
}
assert HANDLERS.keys() == COMMANDS.keys(), "every command has one handler"


if __name__ == "__main__":
    sys.exit(main())
