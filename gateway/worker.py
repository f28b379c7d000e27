"""The gateway's gunicorn worker: gthread, with connections closed off the worker's main loop.

gunicorn's gthread worker closes a finished connection "gracefully" (send
FIN, then read until the peer closes, for up to 2 s) on the main thread, the
one that accepts and polls for every connection of the worker. A client that
stalled mid-request and was timed out (WEB_READ_TIMEOUT_SECONDS) never closes
its side, so each one would freeze the whole worker for 2 s. Here the
request's own pool thread does that close, and the main loop only forgets a
socket that is already closed.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

from gunicorn import util
from gunicorn.workers import gthread


class _ReadTimeoutFilter(logging.Filter):
    """gunicorn logs a full traceback for a read that timed out; one line says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            record.msg, record.args, record.exc_info, record.exc_text = (
                "client stalled past the read timeout",
                (),
                None,
                None,
            )
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


class ThreadWorker(gthread.ThreadWorker):
    """gthread; a connection that will not be kept alive is closed by the thread that served it."""

    def init_process(self) -> None:
        """Install the log filter, then run the worker."""
        self.log.error_log.addFilter(_ReadTimeoutFilter())
        super().init_process()

    def handle(self, conn: Any) -> Any:
        """Serve the connection as gthread does; close it here when it is done with."""
        keep = super().handle(conn)
        if not keep:
            # The main loop's close afterwards finds the socket closed and returns at once.
            util.close_graceful(conn.sock)
        return keep
