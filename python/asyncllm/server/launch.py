"""Running the app under uvicorn (uvloop and httptools when installed), with a
graceful shutdown: on SIGINT/SIGTERM stop accepting, let in-flight requests finish
for `shutdown_timeout` seconds, then abort what is left (their streams end with
finish_reason "abort"), stop the engine core, and exit 0.

When the engine dies (its core, or the front end's output handler), the server
does not linger answering 503: in-flight requests fail at once (503, or an error
event in their stream), and once they have been answered the server stops and
exits 1, so that a supervisor restarts it. The engine core ignores SIGTERM and
SIGINT, so a signal to the whole process group drains like one to the server."""

from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from asyncllm.config import EngineArgs
from asyncllm.frontend.async_llm import AsyncLLM
from asyncllm.server.app import abort_in_flight, build_app
from asyncllm.server.connection import uvicorn_options
from asyncllm.server.serving_base import ServerConfig

logger = logging.getLogger(__name__)

# uvicorn cancels whatever is still running this long after the aborts.
_CANCEL_MARGIN_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn's server with a grace period that ends in aborts, and no re-raised
    signal at exit (the process exits with the engine's status instead)."""

    def __init__(self, config: uvicorn.Config, on_exit: object, engine: AsyncLLM) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._engine = engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self.signalled = False
        self.engine_died = False

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        self._loop = asyncio.get_running_loop()
        watcher = asyncio.ensure_future(self._exit_when_engine_dies())
        try:
            await super().serve(sockets)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def _exit_when_engine_dies(self) -> None:
        """Stop serving once the engine is dead. uvicorn's shutdown then closes the
        listener and lets every in-flight response (already failed) finish."""
        error = await self._engine.wait_until_dead()
        logger.error("the engine died (%s); stopping the server", error)
        self.engine_died = True
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()
        if first and self._loop is not None:
            self.signalled = True
            self._loop.call_soon_threadsafe(self._on_exit)  # type: ignore[arg-type]


def run_server(
    engine_args: EngineArgs,
    config: ServerConfig,
    host: str,
    port: int,
    *,
    log_level: str = "info",
    access_log: bool = False,
) -> int:
    """Serve until a signal; returns the process's exit status."""
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        app = build_app(engine, config)
        uv_config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=access_log,
            timeout_graceful_shutdown=int(config.shutdown_timeout + _CANCEL_MARGIN_S),
            timeout_keep_alive=5,
            root_path=config.root_path,
            **uvicorn_options(config),
        )
        tasks: set[asyncio.Task[None]] = set()

        async def drain() -> None:
            await asyncio.sleep(config.shutdown_timeout)
            logger.info("grace period over: aborting in-flight requests")
            await abort_in_flight(app)

        def on_exit() -> None:
            logger.info("shutting down: finishing in-flight requests")
            task = asyncio.ensure_future(drain())
            tasks.add(task)

        server = _Server(uv_config, on_exit, engine)
        server.run()
        for task in tasks:
            task.cancel()
        # Not `engine.errored` now: the loop's end has cancelled the output handler.
        dead = server.engine_died
    finally:
        engine.shutdown()
    if dead:
        logger.error("the engine core had died; exiting with status 1")
        return 1
    return 0
