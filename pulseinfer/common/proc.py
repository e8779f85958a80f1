"""Process plumbing shared by every service: logging, clean shutdown on signals, parent death."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
PARENT_ENV = "PULSEINFER_PARENT_PID"  # set by the launcher in each child's environment


def setup_logging(service: str) -> logging.Logger:
    logging.basicConfig(
        level=os.environ.get("PULSEINFER_LOG", "INFO"), format=f"%(asctime)s {service}[%(process)d] %(levelname)s %(message)s"
    )
    return logging.getLogger(service)


def stop_on_signals() -> threading.Event:
    """SIGTERM/SIGINT set the returned event; service loops poll it and then release what they
    hold. (An exception raised from a signal handler can land in a destructor and be lost.)"""
    stop = threading.Event()

    def handler(_signum: int, _frame) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def die_with_parent() -> None:
    """In a child of the launcher ($PULSEINFER_PARENT_PID): the kernel sends SIGTERM when the
    launcher dies, even by kill -9. Set first thing after exec, not in a preexec_fn: that makes
    subprocess fork() for real, and a fork while the launcher's gRPC probe shuts its core down
    deadlocked in gRPC's fork handler (the launcher hung starting the gateway)."""
    parent = os.environ.get(PARENT_ENV)
    if parent is None:
        return
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os._exit(1)


def run_service(service: str, main) -> None:
    """Entry point wrapper: a configuration or startup error is one line and exit code 2."""
    die_with_parent()
    try:
        main()
    except (ValueError, RuntimeError, OSError) as e:
        print(f"{service}: error: {e}", file=sys.stderr)
        sys.exit(2)
