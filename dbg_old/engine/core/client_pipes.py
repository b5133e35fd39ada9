"""`ClientPipes`: the engine process's end of its clients' sockets, one pair per client process.

A client is the in-process `Engine`, or one API server process of `siesta serve` (several with
`--api-server-count`). Each client binds a pair (to core, from core); the engine connects a PULL
inbox to the first and a PUSH outbox to the second of every pair. Rules:
- a request's deltas go to the client that added it (`route`); a refusal at arrival goes back to
  its sender, whoever owns a running request of that id;
- a control call's reply goes to its caller, and the engine state it carries to every other client
  as a `StateUpdate`, so every API server refuses (503) and labels responses (weight version) as
  the engine is now, whichever server the call came through;
- `Ready` and `Failed` go to every client.
With one client nothing is routed: every message goes to its one outbox.
"""

from __future__ import annotations

import contextlib

import msgspec
import zmq

from engine.core.availability import EngineState
from engine.core.protocol import (
    FromCore,
    RequestDelta,
    StateUpdate,
    StepOutputs,
    ToCore,
    connect_pipes,
)


class ClientPipes:
    def __init__(self, pipes: list[tuple[str, str]]) -> None:
        """`pipes`: (to-core address, from-core address) of each client, in client order."""
        self.ctx = zmq.Context()
        self.inboxes: list[zmq.Socket] = []
        self.outboxes: list[zmq.Socket] = []
        self.poller = zmq.Poller()
        for in_addr, out_addr in pipes:
            _, inbox, outbox = connect_pipes(in_addr, out_addr, self.ctx)
            self.poller.register(inbox, zmq.POLLIN)
            self.inboxes.append(inbox)
            self.outboxes.append(outbox)
        self._index = {sock: i for i, sock in enumerate(self.inboxes)}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToCore)
        # request id -> the client that added it; kept only with several clients.
        self._owner: dict[str, int] = {}
        self.routed = len(pipes) > 1

    def poll(self, timeout_ms: int) -> list[tuple[int, bytes]]:
        """(client, message) for every message waiting now, after waiting up to `timeout_ms` for
        the first."""
        ready = self.poller.poll(timeout_ms)
        out = []
        for sock, _ in ready:
            client = self._index[sock]
            while True:
                try:
                    out.append((client, sock.recv(flags=zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return out

    def decode(self, data: bytes) -> ToCore:
        return self._decoder.decode(data)

    def send(self, client: int, msg: FromCore) -> None:
        self.outboxes[client].send(self._encoder.encode(msg))

    def broadcast(self, msg: FromCore) -> None:
        data = self._encoder.encode(msg)
        for outbox in self.outboxes:
            outbox.send(data)

    def added(self, client: int, request_id: str) -> None:
        """A request from `client` joined the engine: its deltas go there."""
        if self.routed:
            self._owner[request_id] = client

    def route(self, deltas: list[RequestDelta]) -> None:
        """Send deltas to the clients that own their requests (one `StepOutputs` each)."""
        if not deltas:
            return
        if not self.routed:
            self.send(0, StepOutputs(deltas=deltas))
            return
        groups: dict[int, list[RequestDelta]] = {}
        owner = self._owner
        for d in deltas:  # a finished request is forgotten
            client = owner.pop(d.request_id, 0) if d.finished else owner.get(d.request_id, 0)
            groups.setdefault(client, []).append(d)
        for client, own in groups.items():
            self.send(client, StepOutputs(deltas=own))

    def state_to_others(self, caller: int, state: EngineState) -> None:
        """The engine state after a control call, to every client but its caller (whose reply
        carries it)."""
        if not self.routed:
            return
        data = self._encoder.encode(StateUpdate(state=state))
        for client, outbox in enumerate(self.outboxes):
            if client != caller:
                with contextlib.suppress(zmq.Again):  # a client that reads nothing (gone) is no reason to stall
                    outbox.send(data, flags=zmq.NOBLOCK)

    def close(self) -> None:
        for sock in (*self.inboxes, *self.outboxes):
            sock.close()
        self.ctx.term()
