"""Process plumbing shared by every service: logging, clean shutdown on signals, parent death."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def setup_logging(service: str) -> logging.Logger:
    logging.basicConfig(
        level=os.environ.get("PULSEINFER_LOG", "INFO"), format=f"%(asctime)s {service}[%(process)d] %(levelname)s %(message)s"
    )
    return logging.getLogger(service)


def exit_on_signals() -> None:
    """SIGTERM/SIGINT raise SystemExit in the main thread, so `finally` blocks release what they hold."""

    def handler(signum: int, _frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


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
