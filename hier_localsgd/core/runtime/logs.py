"""Logging of a replica-group process: tagged lines, one per record on a console.

Shared by ``hier-localsgd`` (cli.py) and a user's program run through
:func:`hier_localsgd.run` (job.py).
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from typing import List, Optional

DEBUG_ENV = "HIER_LOCALSGD_DEBUG"  # set (not "0"): tracebacks on the console too
LOG_FORMAT = "%(asctime)s %(levelname)s [%(tag)s] %(name)s: %(message)s"


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "0") not in ("", "0")


class OneLineFormatter(logging.Formatter):
    """Formats a record as one line for a console: a traceback, or a message's further lines,
    is left out and the line names the log file that has it."""

    def __init__(self, fmt: str, log_file: str) -> None:
        super().__init__(fmt)
        self.log_file = log_file

    def format(self, record: logging.LogRecord) -> str:
        # The record is shared with the file handler: hide its traceback only while formatting.
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            text = super().format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved
        line, more, _ = text.partition("\n")
        if more or saved[0] or saved[2]:
            line += f" (details in {self.log_file})"
        return line


def _stderr_is_a_file() -> bool:
    try:
        return stat.S_ISREG(os.fstat(sys.stderr.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):
        return False


def setup_logging(level: str, tag: str, log_file: Optional[str] = None) -> None:
    """Logs to stderr, tagged.

    With ``log_file``, when stderr is a terminal or a pipe (a console, not a log), every
    record also goes in full to ``log_file`` and the console gets one line per record
    (tracebacks only with ``HIER_LOCALSGD_DEBUG=1``). When stderr already is a file (the
    local launcher and torchrun redirect it to the process's log), it gets everything.
    """
    from hier_localsgd.core.runtime.runtime import LOG_TAG

    LOG_TAG.tag = tag
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handlers: List[logging.Handler] = [handler]
    if log_file is not None and not _stderr_is_a_file():
        os.makedirs(os.path.dirname(log_file) or ".", exist_ok=True)
        to_file = logging.FileHandler(log_file, mode="a")  # append across restarts, as the launcher's logs
        to_file.setFormatter(logging.Formatter(LOG_FORMAT))
        handlers.append(to_file)
        if not debug():
            handler.setFormatter(OneLineFormatter(LOG_FORMAT, log_file))
    for h in handlers:
        h.addFilter(LOG_TAG)
    root = logging.getLogger()
    root.handlers[:] = handlers
    root.setLevel(logging.WARNING)
    logging.getLogger("hier_localsgd").setLevel(level.upper())
