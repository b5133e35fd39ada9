"""`EventStream`: a server-sent-event response that runs its jobs and sends their events from the
engine client's reader, native and OpenAI routes alike (what the events hold is an `Events`).

Rules:
- The jobs are sent to the engine right after the response's first events (OpenAI's role or echo
  chunks), before any token, in one message: the engine adds them all before its next step.
- The stream is a push consumer of the engine client (`after_drain`): once the reader has
  applied every engine message queued, it takes what each job gained, renders one blob and sends
  it as one ASGI body message, from the reader itself. No task wakes per event, and a stream
  that the engine outruns gets one event per job per drain, however many steps that covers.
- A send that cannot complete at once (HTTP flow control: the client reads slowly) is finished
  by a task of its own; later blobs queue behind it, in order, and the reader never waits.
- The request's own task waits for the end and watches for the client's disconnect: a client
  gone away aborts every job still running, at once. An engine failure after the status line is
  an in-band error event (`{"error": {...}}`). Every stream ends with `data: [DONE]`, unless
  its client went away.
- Metrics: each job is recorded when it ends: by finish reason, or as error / unavailable /
  disconnected.
- Event JSON is msgspec's: compact, UTF-8 (no \\u escapes), non-finite floats as null. The
  OpenAI routes wrote it with json.dumps before: the same values, other spacing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
from fastapi.responses import Response

from engine.client.async_client import AsyncEngineClient
from engine.client.output import GenerationOutput, LiveRequest, StepUpdate
from engine.errors import EngineUnavailable
from server.errors import error_body
from server.generation import Job, open_job
from server.metrics import Metrics, RequestTracker

DONE = b"data: [DONE]\n\n"
_JSON = msgspec.json.Encoder()

Batch = Sequence[tuple[Job, StepUpdate, GenerationOutput]]


class Events(Protocol):
    """What one stream's events hold, as bytes of whole `data: ...\\n\\n` events."""

    def first(self) -> bytes:
        """Before any token (may be empty)."""

    def render(self, batch: Batch) -> bytes:
        """The events of a batch: each job that changed since the last batch, once, in job order;
        a job's last update is `finished`. May be empty (nothing worth an event yet)."""

    def end(self, outs: dict[int, GenerationOutput]) -> bytes:
        """After every job has ended, before [DONE] (may be empty)."""


def event(data: Any) -> bytes:
    return b"data: " + _JSON.encode(data) + b"\n\n"


class EventStream(Response):
    """The response of one streamed request: `jobs` run in the engine, `events` says what is sent."""

    media_type = "text/event-stream"

    def __init__(self, client: AsyncEngineClient, metrics: Metrics, jobs: list[Job], events: Events) -> None:
        self.client, self.metrics, self.jobs, self.events = client, metrics, jobs, events
        self.status_code = 200
        self.background = None
        self.init_headers(None)
        self._running: list[tuple[Job, LiveRequest, RequestTracker]] = []
        self._outs: dict[int, GenerationOutput] = {}
        self._scheduled = False  # a flush is asked of the reader
        self._opening = True  # jobs are still being sent: the stream cannot end yet
        self._ended = False  # the last message is written or queued (or the client is gone)
        self._queue: list[dict[str, Any]] = []  # messages behind a send that waits
        self._sending: asyncio.Task[None] | None = None  # finishes a send that waits, then the queue

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self._send = send
        self._done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            try:
                first = self.events.first()
                if first:
                    self._write(first)
                for job in self.jobs:
                    if self._ended:  # the client went away meanwhile
                        break
                    self._running.append((job, *open_job(self.client, self.metrics, job, True, self)))
                if self._running and not self._ended:  # in one message (`AddRequests`)
                    await self.client.submit(*(live for _, live, _ in self._running))
                self._opening = False
                if not self._running and not self._ended:  # every job ended before the sending returned
                    self._end(self.events.end(self._outs) + DONE)
            except Exception as e:
                self._fail(e)
            await self._done
        finally:
            watcher.cancel()
            if self._sending is not None:
                self._sending.cancel()
            self._stop("disconnected")

    # ---- from the engine client's reader -----------------------------------------------------

    def set(self) -> None:
        """A job changed: ask for a flush once the reader has drained the engine's messages."""
        if not self._scheduled:
            self._scheduled = True
            self.client.after_drain(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self._ended:
            return
        try:
            batch = []
            ended = False
            for job, live, _ in self._running:
                if live.error is not None:
                    raise live.error
                if live.ready:
                    update, out = live.take(), live.state.output
                    refusal = out.refusal()
                    if refusal is not None:
                        raise refusal
                    ended = ended or update.finished
                    batch.append((job, update, out))
                    self._outs[job.index] = out
            if not batch:
                return
            if ended:
                self._retire()
            data = self.events.render(batch)
            if not self._running and not self._opening:
                self._end(data + self.events.end(self._outs) + DONE)
            elif data:
                self._write(data)
        except Exception as e:
            self._fail(e)

    def _retire(self) -> None:
        """Close and record the jobs whose last update was just taken."""
        still = []
        for entry in self._running:
            job, live, tracker = entry
            out = live.state.output
            if out.finished and not live.ready:
                self.client.close(live)
                tracker.finish(out.finish_reason or "abort", len(job.prompt_token_ids))
            else:
                still.append(entry)
        self._running = still

    # ---- ends ---------------------------------------------------------------------------------

    def _fail(self, e: Exception) -> None:
        """The status line is sent already: report in-band, then [DONE]."""
        self._stop("unavailable" if isinstance(e, EngineUnavailable) else "error")
        if not self._ended:
            self._end(event(error_body(e)) + DONE)

    def _stop(self, outcome: str) -> None:
        """Close (aborting in the engine) and record every job still running."""
        running, self._running = self._running, []
        for job, live, tracker in running:
            self.client.close(live)
            tracker.finish(outcome, len(job.prompt_token_ids))

    async def _watch(self, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._gone()

    def _gone(self) -> None:
        """The client went away: abort what runs, send nothing more."""
        self._ended = True
        self._stop("disconnected")
        if self._sending is not None:
            self._sending.cancel()
        self._finished()

    # ---- sending ------------------------------------------------------------------------------

    def _end(self, data: bytes) -> None:
        self._ended = True
        self._write(data, more=False)

    def _write(self, data: bytes, more: bool = True) -> None:
        """Send a body message now if the server takes it at once, else queue it behind a task."""
        message = {"type": "http.response.body", "body": data, "more_body": more}
        if self._sending is not None:
            self._queue.append(message)
            return
        sending = self._send(message)
        try:
            waiting = sending.send(None)
        except StopIteration:
            if not more:
                self._finished()
            return
        except Exception as e:
            self._broken(e)
            return
        self._sending = asyncio.ensure_future(self._finish_sending(sending, waiting, more))

    async def _finish_sending(self, sending: Any, waiting: Any, more: bool) -> None:
        """Drive a send that waits (on what it yielded) to its end, then send the queue in order."""
        try:
            while True:
                if isinstance(waiting, asyncio.Future):
                    await asyncio.wait((waiting,))  # the send itself reads the outcome when resumed
                else:
                    await asyncio.sleep(0)  # a bare yield: resume on the next loop pass
                try:
                    waiting = sending.send(None)
                except StopIteration:
                    break
                except asyncio.CancelledError as e:  # what it waited on was cancelled: not this task
                    raise RuntimeError("an SSE send was cancelled") from e
            while self._queue:
                message = self._queue.pop(0)
                await self._send(message)
                more = message["more_body"]
        except asyncio.CancelledError:  # the client went away, or the request ended
            sending.close()
            raise
        except Exception as e:
            sending.close()
            self._sending = None
            self._broken(e)
            return
        finally:
            self._sending = None
        if not more:
            self._finished()

    def _finished(self) -> None:
        if not self._done.done():
            self._done.set_result(None)

    def _broken(self, e: Exception) -> None:
        """A send failed: the client went away (ASGI 2.4 servers raise OSError then), or worse
        (the request's task raises it). Nothing more is sent."""
        if isinstance(e, OSError):
            self._gone()
            return
        self._ended = True
        self._stop("error")
        if not self._done.done():
            self._done.set_exception(e)
