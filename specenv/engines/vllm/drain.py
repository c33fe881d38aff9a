"""The clean stop of ``specenv serve``: on SIGTERM/SIGINT every request accepted before it is answered.

vLLM 0.32's OpenAI server stops like this: its signal handler calls ``engine_client.shutdown(timeout)``
(``timeout`` = ``--shutdown-timeout``) at once, which sends SIGTERM to the engine-core process; that
process drains the requests *its scheduler holds* for up to the timeout and answers every request
still in its input queue -- accepted by the HTTP server before the signal, not yet scheduled -- with
an empty ``finish_reason="abort"`` completion (HTTP 200). Meanwhile the HTTP server keeps accepting
requests, which get the same answer. Then ``AsyncLLM.shutdown`` closes the engine's output socket
*before* it cancels its output handler, so the handler logs an ``EngineDeadError`` traceback on every
stop of a server that has served a request (vLLM issue 48745).

:class:`DrainGate` is an ASGI middleware installed through vLLM's own ``--middleware`` option
(:func:`specenv.engines.vllm.settings.shutdown_args` adds it). It makes the stop a front-door drain,
the order a load balancer expects:

1. at the signal the gate closes: a request that arrives after it is answered HTTP 503 with an
   OpenAI-style error body (``"server is shutting down"``; the OpenAI client reports it, or retries
   and then reports the refused connection) -- never an empty success;
2. every HTTP request that passed the gate before it (streaming or not), and every request the engine
   client still tracks, runs to its normal end on the still-running engine, for up to
   ``--shutdown-timeout`` seconds (0: no wait, vLLM's abort);
3. with nothing left in flight, the engine client's output handler is cancelled (an idle handler:
   nothing is lost), then vLLM's own shutdown runs (with its whole ``--shutdown-timeout``): the
   engine core gets SIGTERM with an empty scheduler, the controller closes the recording (its last
   part written), the engine core tears its worker down and the process exits 0 -- no traceback.

If requests are still running when the timeout ends, vLLM's shutdown runs as without the gate (the
engine core aborts what it holds: those clients get ``finish_reason="abort"``) and the gate logs how
many were cut.

The one place where the gate reaches into vLLM: at the server's start (the ASGI lifespan event) it
wraps the ``shutdown`` method of the app's engine client (``app.state.engine_client``) with steps 1-3,
because the launcher calls it first thing on a signal and vLLM 0.32 has no pre-shutdown hook.
SIGTERM must go to the API server (the ``specenv serve`` process), as for any vLLM server: an
engine-core process signalled directly drains only its scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["DrainGate", "SHUTTING_DOWN_MESSAGE"]

try:  # vLLM's log format and level (VLLM_LOGGING_LEVEL) where vLLM is installed
    from vllm.logger import init_logger

    logger = init_logger("vllm.specenv.drain")  # under vLLM's logger: printed with the server's messages
except ImportError:  # pragma: no cover - the gate is only installed in a vLLM server
    logger = logging.getLogger("specenv.engines.vllm.drain")

#: The error message of a request refused after the signal (HTTP 503).
SHUTTING_DOWN_MESSAGE = "server is shutting down (SIGTERM): request not accepted, retry on another server"
_POLL_S = 0.02

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class DrainGate:
    """ASGI middleware: counts HTTP requests in flight and refuses new ones once the stop began (module doc).

    Attributes:
        in_flight: HTTP requests that passed the gate and have not finished.
        closed: The stop began: new requests are answered 503.
        refused: Requests answered 503 since then.
    """

    def __init__(self, app: Any):
        self.app = app
        self.in_flight = 0
        self.closed = False
        self.refused = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: Any = None
        self._lock = threading.Lock()
        self._drained = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry: binds at the lifespan start, counts HTTP requests, refuses them once closed."""
        if scope["type"] == "lifespan":
            self._bind(scope)
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.closed:
            self.refused += 1
            await _refuse(send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    # ------------------------------------------------------------------ the stop
    def _bind(self, scope: Scope) -> None:
        """Wrap the engine client's ``shutdown`` with the drain (once; at the lifespan start)."""
        if self._engine is not None:
            return
        app = scope.get("app")
        engine = getattr(getattr(app, "state", None), "engine_client", None)
        if engine is None or not callable(getattr(engine, "shutdown", None)):
            logger.warning("specenv drain gate: no engine client on the app; SIGTERM stops as vLLM does")
            return
        self._loop = asyncio.get_running_loop()
        self._engine = engine
        original = engine.shutdown

        def shutdown(timeout: float | None = None) -> None:
            self.drain(timeout)
            # vLLM's own shutdown keeps its whole timeout: an engine core still holding requests (a drain
            # cut short) must not be killed before it writes the recording's last part
            original(timeout=timeout)

        engine.shutdown = shutdown

    def drain(self, timeout: float | None) -> bool:
        """Close the gate, let what is in flight finish (up to ``timeout`` s), then quiet the output handler.

        Runs on the thread vLLM's launcher calls ``engine_client.shutdown`` from (not the event loop's).

        Returns:
            Whether nothing was left in flight (False also on a second call).
        """
        with self._lock:
            if self._drained:
                return False
            self._drained = True
        self.closed = True
        t0 = time.monotonic()
        wait = float(timeout or 0.0)
        busy = self._busy()
        if wait > 0:
            logger.info(
                "[shutdown] specenv drain gate: closed; waiting for %d HTTP request(s) in flight (at most %g s)",
                busy[0],
                wait,
            )
            while any(busy) and time.monotonic() - t0 < wait:
                time.sleep(_POLL_S)
                busy = self._busy()
        spent = time.monotonic() - t0
        if any(busy):
            logger.warning(
                "[shutdown] specenv drain gate: %d HTTP / %d engine request(s) still running after %.1f s "
                "(--shutdown-timeout %g): vLLM aborts them",
                busy[0],
                busy[1],
                spent,
                wait,
            )
        else:
            logger.info(
                "[shutdown] specenv drain gate: drained in %.2f s (%d refused); stopping the engine",
                spent,
                self.refused,
            )
            self._quiet_output_handler()
        return not any(busy)

    def _busy(self) -> tuple[int, int]:
        """(HTTP requests in flight, requests the engine client still tracks)."""
        n_engine = 0
        count = getattr(self._engine, "get_num_unfinished_requests", None)
        if count is not None:
            with contextlib.suppress(Exception):  # a dying engine client: count HTTP requests only
                n_engine = int(count())
        return self.in_flight, n_engine

    def _quiet_output_handler(self) -> None:
        """Cancel the engine client's (idle) output handler on its loop, so the engine's teardown is not an error."""
        task = getattr(self._engine, "output_handler", None)
        loop = self._loop
        if task is None or loop is None or loop.is_closed() or task.done():
            return

        async def cancel() -> None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        fut = asyncio.run_coroutine_threadsafe(cancel(), loop)
        with contextlib.suppress(Exception):
            fut.result(timeout=5.0)


async def _refuse(send: Send) -> None:
    """Answer HTTP 503 with an OpenAI-style error body."""
    body = json.dumps(
        {"error": {"message": SHUTTING_DOWN_MESSAGE, "type": "ServiceUnavailableError", "param": None, "code": 503}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
