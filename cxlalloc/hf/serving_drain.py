"""Cancellation and drain for ``cxlalloc serve`` (:mod:`cxlalloc.hf.serving`): what a server cancelled
(:class:`ServeStatus`), the ASGI middleware that cancels a completion request whose client went away or that
still runs at the drain deadline (:class:`DisconnectMiddleware`), and how such a response is ended in OpenAI's
error form (:func:`end_drained`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Callable, List, Optional

from cxlalloc.hf.serving_requests import InvalidRequest

COMPLETION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# how long a request cancelled at the drain deadline is waited for after its error was sent (its handler's own
# clean-up); the process does not wait for it beyond this
DRAIN_TASK_WAIT_S = 0.5
# uvicorn's message when it cancels the requests still running at timeout_graceful_shutdown (uvicorn/server.py)
UVICORN_DEADLINE_CANCEL = "timeout graceful shutdown exceeded"
# the message cxlalloc serve cancels them with on uvicorn's force quit (a second SIGINT)
FORCE_QUIT_CANCEL = "force quit"


class ServeStatus:
    """What one server cancelled and what its continuous-batching manager holds (read by ``/metrics`` and by
    ``cxlalloc serve``'s exit status).

    Attributes:
        cancelled: ``{"disconnect": n, "drain": n}``: completion requests cancelled before their answer was
            sent, because their client went away, or because ``drain_timeout`` ran out at shutdown.
        engine_cancelled: of those, the requests stopped where they were computed:
            ``"continuous_batching"``, cancelled in transformers' continuous-batching manager
            (``cancel_request``: removed from its scheduler, their blocks freed); ``"generate"``, a
            non-streamed ``model.generate()`` stopped at its next token (``--no-continuous-batching``).
        managers: the continuous-batching managers made (normally one).
        drain_timeout: the server's drain deadline, seconds after the shutdown signal (None: not known).
        signals: the names of the shutdown signals uvicorn caught (``"SIGTERM"``, ``"SIGINT"``), in order.
        force_quit: None, or why the server is force-quitting with requests still running: ``"deadline"``
            (the drain deadline passed) or ``"force"`` (stopped at once: a second SIGINT, uvicorn's force quit).
        on_force_quit: callables run once, with the reason, when :meth:`force_quitting` is first called
            (``cxlalloc serve`` bounds its exit with one).
    """

    def __init__(self, drain_timeout: Optional[float] = None) -> None:
        self.lock = threading.Lock()
        self.cancelled = {"disconnect": 0, "drain": 0}
        self.engine_cancelled = {"continuous_batching": 0, "generate": 0}
        self.managers: List[Any] = []
        self.drain_timeout = drain_timeout
        self.signals: List[str] = []
        self.force_quit: Optional[str] = None
        self.on_force_quit: List[Callable[[str], None]] = []

    def force_quitting(self, reason: str) -> None:
        """The server is force-quitting (``reason``: ``"deadline"`` or ``"force"``) with requests still running:
        the first call stops every continuous-batching worker at its next step (transformers' hard stop: what
        it still holds is failed, nothing more is computed for a request whose answer is already ended) and
        runs :attr:`on_force_quit`; later calls do nothing."""
        with self.lock:
            if self.force_quit is not None:
                return
            self.force_quit = reason
            managers = list(self.managers)
        for m in managers:
            cb = getattr(m, "_cb", None)
            if cb is not None:  # transformers 5.24's ContinuousBatchingManager.stop(hard_stop=True), not waited for
                with contextlib.suppress(Exception):
                    cb.background_thread_status.request_stop(cb.background_thread_status.HARD_STOP,
                                                             cb.distributed_helper.global_rank)
                    cb._wake_up_loop.set()
        for fn in list(self.on_force_quit):
            fn(reason)

    def drain_message(self) -> str:
        """What a request cancelled by the force quit is told (OpenAI's error ``message``)."""
        n = f" of {self.drain_timeout:g} s" if self.drain_timeout is not None else ""
        if self.force_quit == "force":
            sig = self.signals[-1] if self.signals else "signal"
            why = f"force-quitting on a second {sig}, before its drain deadline{n} (--drain-timeout),"
        else:
            why = f"force-quitting after its drain deadline{n} (--drain-timeout)"
        return f"the server is {why} and this request was still running; retry it on another server"

    def count(self, reason: Optional[str] = None, engine: Optional[str] = None) -> None:
        """One more request cancelled for ``reason`` (``"disconnect"``/``"drain"``), or stopped in ``engine``
        (``"continuous_batching"``/``"generate"``)."""
        with self.lock:
            if engine is not None:
                self.engine_cancelled[engine] += 1
            else:
                self.cancelled[reason] += 1

    def cb_requests(self) -> int:
        """Requests the continuous-batching scheduler(s) hold now (running and waiting)."""
        n = 0
        for m in list(self.managers):
            cb = getattr(m, "_cb", None)
            sched = getattr(getattr(cb, "batch_processor", None), "scheduler", None)
            if sched is not None:
                n += len(sched.active_requests) + len(sched.waiting_requests)
        return n


class DisconnectMiddleware:
    """ASGI middleware: a completion request whose client goes away is cancelled.

    Starlette cancels a streamed response when the client disconnects, but not a
    non-streamed one: its handler awaits the whole generation (a 100k-character
    prompt kept the server computing for minutes after the client left).  Here
    the request body is read first, then the route runs in its own task while
    the connection is watched; an ``http.disconnect`` before the response is
    complete cancels that task (the continuous-batching manager then cancels the
    request: :func:`cxlalloc.hf.serving_managers.guarded_cb_manager`).  A cancellation of this middleware
    itself (uvicorn's drain deadline) is passed on the same way, its reason
    ``"drain"``.  With ``--no-continuous-batching`` a non-streamed request's
    ``generate()`` stops at its next token (:func:`cxlalloc.hf.serving_managers.stoppable_generate_manager`).
    """

    def __init__(self, app, status: Optional[ServeStatus] = None) -> None:
        self.app = app
        self.status = status if status is not None else ServeStatus()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in COMPLETION_ROUTES:
            return await self.app(scope, receive, send)
        body = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before its request was read: nothing was started
            body.append(message)
            if not message.get("more_body"):
                break
        gone = asyncio.Event()
        complete = [False]

        async def inner_receive():
            if body:
                return body.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        started = [False]
        ended = [False]  # the middleware ended the response itself: the route's later messages are dropped

        async def inner_send(message):
            if ended[0]:
                return
            if message["type"] == "http.response.start":
                started[0] = True
            if message["type"] == "http.response.body" and not message.get("more_body"):
                complete[0] = True
            await send(message)

        holder = {"reason": None}
        task = asyncio.ensure_future(self.app(scope, inner_receive, inner_send))
        watcher = asyncio.ensure_future(receive())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and not complete[0]:  # the client went away with its answer unsent
                holder["reason"] = "disconnect"
                self.status.count("disconnect")
                gone.set()
                task.cancel()
            gone.set()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        except asyncio.CancelledError as e:  # uvicorn cancels the requests still running at the drain deadline
            if holder["reason"] is not None or task.done():
                raise
            holder["reason"] = "drain"
            self.status.count("drain")
            # uvicorn cancels with its message at the deadline; on a force quit (a second SIGINT) the server
            # cancels with FORCE_QUIT_CANCEL (cxlalloc.hf.serving), or the event loop's end without a message
            deadline = any(UVICORN_DEADLINE_CANCEL in str(a) for a in e.args)
            self.status.force_quitting("deadline" if deadline else "force")
            # the answer is ended at once in OpenAI's error form (a 503, or an SSE error event ending the stream),
            # so the client learns why without waiting for the route's clean-up, and uvicorn logs no traceback
            ended[0] = True
            await end_drained(send, started[0], complete[0], self.status.drain_message())
            task.cancel()
            task.add_done_callback(_retrieve)
            with contextlib.suppress(asyncio.CancelledError):  # the event loop's own end cancels this wait
                await asyncio.wait({task}, timeout=DRAIN_TASK_WAIT_S)
        finally:
            watcher.cancel()


def _retrieve(task) -> None:
    """Done callback of a task nobody awaits to its end: its exception is read (asyncio logs none)."""
    if not task.cancelled():
        task.exception()


async def end_drained(send, started: bool, complete: bool, message: str) -> None:
    """End a response cancelled by a force quit (``message``: :meth:`ServeStatus.drain_message`): a 503 in
    OpenAI's error form if nothing was sent yet, else an SSE ``error`` event closing the stream (the ``openai``
    client raises ``APIError`` with it)."""
    import json

    err = InvalidRequest(None, message, status=503, code="server_shutting_down", kind="server_error").body()
    with contextlib.suppress(Exception):  # the client may be gone too
        if not started:
            data = json.dumps(err).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": data})
        elif not complete:
            await send({"type": "http.response.body", "body": f"data: {json.dumps(err)}\n\n".encode()})

