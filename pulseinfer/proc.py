"""Process plumbing shared by every service: logging, clean shutdown on signals, parent death."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1


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


def die_with_parent(parent_pid: int) -> None:
    """Run in a child before exec: the kernel sends SIGTERM when the launcher dies, even by kill -9."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def run_service(service: str, main) -> None:
    """Entry point wrapper: a configuration or startup error is one line and exit code 2."""
    try:
        main()
    except (ValueError, RuntimeError, OSError) as e:
        print(f"{service}: error: {e}", file=sys.stderr)
        sys.exit(2)
