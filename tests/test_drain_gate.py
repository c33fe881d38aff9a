"""The drain gate of `specenv serve` (specenv/engines/vllm/drain.py) on a stand-in ASGI app and engine client.

What vLLM's launcher does on SIGTERM -- ``engine_client.shutdown(timeout)`` on an executor thread -- is
replayed here: the gate must refuse new requests at once (HTTP 503, OpenAI-style body), let the one in
flight finish, cancel the idle output handler, and only then call the engine's own shutdown with the
same timeout.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from specenv.engines.vllm.drain import SHUTTING_DOWN_MESSAGE, DrainGate


class _Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[float | None, bool]] = []
        self.output_handler: asyncio.Task | None = None

    def get_num_unfinished_requests(self) -> int:
        return 0

    def shutdown(self, timeout: float | None = None) -> None:
        handler_done = self.output_handler is not None and self.output_handler.done()
        self.calls.append((timeout, handler_done))


async def _call(gate: DrainGate, path: str = "/v1/completions") -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(msg: dict) -> None:
        sent.append(msg)

    await gate({"type": "http", "path": path, "method": "POST"}, receive, send)
    return sent


def test_sigterm_refuses_new_requests_drains_the_running_one_then_stops_the_engine():
    release = asyncio.Event()
    order: list[str] = []

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            return
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})
        order.append("request finished")

    async def main() -> None:
        engine = _Engine()
        engine.output_handler = asyncio.create_task(asyncio.sleep(3600))
        gate = DrainGate(app)
        await gate(
            {"type": "lifespan", "app": SimpleNamespace(state=SimpleNamespace(engine_client=engine))}, None, None
        )
        running = asyncio.create_task(_call(gate))
        await asyncio.sleep(0.01)
        assert gate.in_flight == 1
        loop = asyncio.get_running_loop()
        stopping = loop.run_in_executor(None, engine.shutdown, 10.0)  # what the launcher does on SIGTERM
        await asyncio.sleep(0.1)
        assert gate.closed and engine.calls == []  # the engine keeps running while a request is in flight
        refused = await _call(gate)
        assert refused[0]["status"] == 503
        body = json.loads(refused[1]["body"])
        assert body["error"]["message"] == SHUTTING_DOWN_MESSAGE and body["error"]["code"] == 503
        release.set()
        ok = await running
        assert ok[0]["status"] == 200
        await stopping
        assert order == ["request finished"]
        ((timeout, handler_done),) = engine.calls  # vLLM's shutdown, once, after the drain
        assert handler_done and engine.output_handler.cancelled()
        assert timeout == 10.0  # vLLM's own shutdown keeps its whole grace period
        assert gate.refused == 1 and gate.in_flight == 0

    asyncio.run(main())


def test_zero_timeout_keeps_vllms_abort_and_leaves_the_output_handler_running():
    async def app(scope, receive, send):
        return

    async def main() -> None:
        engine = _Engine()
        engine.output_handler = asyncio.create_task(asyncio.sleep(3600))
        gate = DrainGate(app)
        await gate(
            {"type": "lifespan", "app": SimpleNamespace(state=SimpleNamespace(engine_client=engine))}, None, None
        )
        gate.in_flight = 1  # a request still running: with --shutdown-timeout 0 nothing waits for it
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown, 0)
        assert engine.calls == [(0, False)] and not engine.output_handler.done()  # it answers the aborts
        engine.output_handler.cancel()

    asyncio.run(main())
