"""AsyncLLM: one engine thread per process serving many asyncio clients.

The engine is not thread safe, so only the engine thread touches it; it also builds it, so
the model's compute threads belong to that thread alone (kvtier/worker/cpu_threads.py).
Clients hand it commands (add, abort) through a queue; it runs `step()` while any request is
unfinished, so requests from all clients are batched together (continuous batching). Each
request's outputs travel back to the client's event loop (`call_soon_threadsafe`) into that
request's one slot: outputs are cumulative, so a client that reads slower than the engine
steps gets the latest, never a backlog of every step's (as vLLM's output collector does).

A failing `step()` fails the requests in flight (each gets the error) and the loop goes on; a
failing abort is logged and the loop goes on. If the loop itself ever ends, every request in
flight gets an EngineDeadError and the engine thread shuts the engine down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.engine.kv_events import EventPublisher

if TYPE_CHECKING:
    from kvtier.engine.outputs import RequestOutput
    from kvtier.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the idle engine thread sleeps on the command queue before re-checking for shutdown.
_IDLE_WAIT_S = 0.05
# Building the engine: loading the model, and the first process on a machine also compiles the
# CPU kernels (~30 s).
DEFAULT_STARTUP_TIMEOUT_S = 900.0
# Stopping the engine thread includes the engine's shutdown: the connector's last copies and its
# flush to the tiers, each bounded by its own deadline (kv_load_timeout_s, tier_job_timeout_s).
DEFAULT_JOIN_TIMEOUT_S = 90.0


class EngineDeadError(RuntimeError):
    """The engine thread is not running (shut down, or never started)."""


class EngineStartupError(RuntimeError):
    """The engine thread did not build the engine within the startup deadline."""


class EngineShuttingDownError(RuntimeError):
    """The engine is draining for shutdown and takes no new requests."""


class EngineStepError(RuntimeError):
    """engine.step() raised while this request was in flight; the request was aborted."""


@dataclass
class _Stream:
    """Where one request's outputs go, on the client's event loop: the latest one not yet
    read (each holds all the tokens so far), or the error that ended the request."""

    loop: asyncio.AbstractEventLoop
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    latest: RequestOutput | BaseException | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        """From the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self._keep, item)
        except RuntimeError:
            # The client's loop is closed: nobody is left to read this.
            pass

    def _keep(self, item: RequestOutput | BaseException) -> None:
        self.latest = item
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self.ready.wait()
        self.ready.clear()
        item, self.latest = self.latest, None
        return item


@dataclass
class _AddCommand:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    options: dict[str, Any]
    stream: _Stream
    accepted: concurrent.futures.Future


@dataclass
class _AbortCommand:
    request_ids: list[str]
    # Abort only if the id is still served to this stream: the id may have been refused (a
    # duplicate of a live request) or already reused by another client.
    stream: _Stream | None = None


class AsyncLLM:
    """Runs an Engine on its own thread; `generate()` streams one request's outputs."""

    def __init__(self, engine_factory: Callable[[], Any], publisher: EventPublisher | None = None,
                 *, submit_timeout_s: float = 60.0, output_timeout_s: float = 600.0,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        """engine_factory builds the engine; it runs on the engine thread, and its exception is
        raised here. submit_timeout_s bounds the wait for the engine thread to accept a
        request; output_timeout_s bounds the wait between two outputs of one request."""
        self.publisher = publisher or EventPublisher()
        self.submit_timeout_s = submit_timeout_s
        self.output_timeout_s = output_timeout_s
        self._commands: queue.Queue[_AddCommand | _AbortCommand] = queue.Queue()
        # The engine thread sleeps on the command queue (no request to step): a command wakes
        # it, no step's wait needs cutting short.
        self._waiting_for_commands = False
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._draining = False
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(engine_factory, built),
                                        name="kvtier-engine", daemon=True)
        self._thread.start()
        try:
            self.engine = built.result(timeout=startup_timeout_s)
        except concurrent.futures.TimeoutError:
            self._stop.set()  # the thread ends once the build returns
            raise EngineStartupError(
                f"the engine was not built within {startup_timeout_s:g} s; raise "
                "startup_timeout_s if loading this model takes longer") from None

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str, **options: Any) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes.

        options go to Engine.add_request (priority, cache_salt, kv_transfer_params,
        lora_request, ...); its ValueError / EngineQueueFullError is raised here before
        anything is yielded. Leaving early (client gone, task cancelled) aborts the request and
        frees its blocks. A structured outputs grammar is compiled, and a LoRA adapter loaded,
        here, on a worker thread, so the engine thread goes on stepping meanwhile.
        """
        if params.structured_outputs is not None and "grammar" not in options:
            options = {**options, "grammar": await self.compile_grammar(params)}
        if options.get("lora_request") is not None and "lora_adapter" not in options:
            # Handed over loaded: with --max-cpu-loras the engine might have dropped it again
            # by the time the engine thread adds the request.
            options = {**options, "lora_adapter": await self.load_lora(options["lora_request"])}
        stream = _Stream(asyncio.get_running_loop())
        try:
            await self._submit_add(_AddCommand(request_id, prompt, params, options, stream,
                                               concurrent.futures.Future()))
        except BaseException:
            # The engine thread may have accepted it just as we stopped waiting; commands run
            # in order, so this abort comes after that add and drops it.
            self._send(_AbortCommand([request_id], stream))
            raise
        finished = False
        try:
            while not finished:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation
                # that lands as the item arrives, and a client's leaving would not abort.
                async with asyncio.timeout(self.output_timeout_s):
                    item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._send(_AbortCommand([request_id], stream))

    async def compile_grammar(self, params: SamplingParams) -> Any:
        """params.structured_outputs compiled on a worker thread, within submit_timeout_s
        (generate does this itself; callers that adjust the grammar first pass it as the
        `grammar` option)."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        async with asyncio.timeout(self.submit_timeout_s):
            return await asyncio.to_thread(self.engine.compile_grammar, params)

    async def load_lora(self, request: Any) -> Any:
        """Engine.load_lora on a worker thread, within submit_timeout_s: reading an adapter
        from disk must not hold up the engine thread's steps."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        async with asyncio.timeout(self.submit_timeout_s):
            return await asyncio.to_thread(self.engine.load_lora, request)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); safe from any thread."""
        self._send(_AbortCommand([request_id]))

    def _send(self, command: _AddCommand | _AbortCommand) -> None:
        """Queue a command for the engine thread and cut short an idle step's wait for
        transfers, so the command is taken at once. An engine thread asleep on the queue takes
        it anyway; interrupting it then would only end its next step's wait for nothing (a
        new disk hit's promotions: one step more)."""
        self._commands.put(command)
        if not self._waiting_for_commands:
            self._interrupt_idle_wait()

    def _interrupt_idle_wait(self) -> None:
        engine = getattr(self, "engine", None)  # None while it is being built
        if engine is not None:
            engine.interrupt_idle_wait()

    async def _submit_add(self, command: _AddCommand) -> None:
        if self._draining:
            raise EngineShuttingDownError("the server is shutting down; retry on another "
                                          "instance")
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        self._send(command)
        async with asyncio.timeout(self.submit_timeout_s):
            await asyncio.wrap_future(command.accepted)

    def shutdown(self, drain_timeout_s: float = 30.0,
                 join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S) -> None:
        """Finish in-flight requests within drain_timeout_s, abort the rest, and stop the
        engine thread, which shuts the engine down on its way out; wait for it at most
        join_timeout_s (then it is abandoned: a daemon thread, it ends with the process)."""
        self._draining = True
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and self.is_running and time.monotonic() < deadline:
            time.sleep(_IDLE_WAIT_S)
        self._stop.set()
        self._interrupt_idle_wait()
        self._thread.join(join_timeout_s)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.1f s; abandoned",
                           join_timeout_s)
        self.publisher.shutdown()

    # ---- engine thread ------------------------------------------------------------------------

    def _build(self, engine_factory: Callable[[], Any], built: concurrent.futures.Future) -> bool:
        try:
            self.engine = engine_factory()
            self._step_errors = self.engine.metrics.counter(
                "kvtier:engine_step_errors", "Engine steps that raised; their requests failed.")
        except BaseException as exc:
            built.set_exception(exc)
            return False
        built.set_result(self.engine)
        return True

    def _run(self, engine_factory: Callable[[], Any], built: concurrent.futures.Future) -> None:
        if not self._build(engine_factory, built):
            return
        if self._stop.is_set():  # the caller gave up waiting for the build
            self.engine.shutdown()
            return
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_events()
        except Exception:
            logger.exception("the engine loop failed; no more requests are served")
        finally:
            self._stop.set()
            dead = EngineDeadError("the engine shut down before the request finished")
            self._fail_all(dead)
            self._refuse_queued_adds(dead)
            self._shutdown_engine()
            self._publish_events()

    def _shutdown_engine(self) -> None:
        """On the engine thread, which alone touches the engine."""
        try:
            self.engine.shutdown()
        except Exception:
            logger.exception("the engine's shutdown failed")

    def _drain_commands(self, block: bool) -> None:
        # Set before the queue is read: a command queued from then on is taken by this drain
        # or, after a timeout with nothing to step, by the next one.
        self._waiting_for_commands = block
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else \
                self._commands.get_nowait()
        except queue.Empty:
            return
        self._waiting_for_commands = False
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _AddCommand | _AbortCommand) -> None:
        if isinstance(command, _AbortCommand):
            self._apply_abort(command)
        else:
            self._apply_add(command)

    def _apply_abort(self, command: _AbortCommand) -> None:
        live = [rid for rid in command.request_ids if rid in self._streams
                and (command.stream is None or self._streams[rid] is command.stream)]
        for rid in live:
            del self._streams[rid]
        if not live:
            return
        try:
            self.engine.abort_request(live)
        except Exception:
            # Their clients are gone already; the others must keep being served.
            logger.exception("aborting requests %s failed", live)

    def _apply_add(self, command: _AddCommand) -> None:
        if not command.accepted.set_running_or_notify_cancel():
            return  # the client stopped waiting (deadline or disconnect) before we got here
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    **command.options)
        except Exception as exc:  # the client sees it as the add's outcome (400 / 503)
            command.accepted.set_exception(exc)
            return
        self._streams[command.request_id] = command.stream
        command.accepted.set_result(None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._step_errors.inc()
            logger.exception("engine step failed; failing the %d requests in flight",
                             len(self._streams))
            self._fail_all(EngineStepError(f"engine step failed: {exc!r}"))
            return
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.put(output)

    def _refuse_queued_adds(self, error: BaseException) -> None:
        """The loop ended: adds it never took get the error now, not at their deadline."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _AddCommand) and \
                    command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(error)

    def _fail_all(self, error: BaseException) -> None:
        request_ids = list(self._streams)
        if not request_ids:
            return
        try:
            self.engine.abort_request(request_ids)
        except Exception:
            logger.exception("aborting the failed requests also failed")
        for request_id in request_ids:
            self._streams.pop(request_id).put(error)

    def _publish_events(self) -> None:
        try:
            events = self.engine.take_kv_events()
        except Exception:
            logger.exception("taking KV events failed")
            return
        if events:
            self.publisher.publish(events)
