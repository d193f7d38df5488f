"""AsyncLLM's engine thread against the real engine on a tiny random Llama: the add / abort
handshake with clients that stop waiting, and a loop that survives a failing abort."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvtier import LLM, SamplingParams
from kvtier.engine.async_llm import AsyncLLM, EngineDeadError, EngineStartupError

from ..tiny_models import make_hf_model

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]
SHORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
# Long enough to be still running while the test does something else (a few ms each).
MEDIUM = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
DEADLINE_S = 30.0


class _Wrapped:
    """The real engine, with some methods changed by a subclass."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)


class _SlowAdd(_Wrapped):
    """The real engine, whose add_request first waits for `release` (the client has given up
    by then)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.release = threading.Event()

    def add_request(self, *args, **kwargs) -> None:
        assert self.release.wait(DEADLINE_S)
        self._engine.add_request(*args, **kwargs)


class _AbortFailsOnce(_Wrapped):
    """The real engine, whose first abort_request raises (e.g. a connector hook failing)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.num_failed = 0

    def abort_request(self, request_ids) -> None:
        if self.num_failed == 0:
            self.num_failed += 1
            raise RuntimeError("abort hook failed")
        self._engine.abort_request(request_ids)


class _CountsInterrupts(_Wrapped):
    """The real engine, counting the calls that cut an idle step's wait short."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.num_interrupts = 0

    def interrupt_idle_wait(self) -> None:
        self.num_interrupts += 1
        self._engine.interrupt_idle_wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", directory)
    return str(directory)


@pytest.fixture
def engine(model_dir):
    llm = LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=128)
    yield llm.engine
    llm.engine.check_invariants()


async def _last(async_llm: AsyncLLM, prompt, params, request_id):
    final = None
    async for final in async_llm.generate(prompt, params, request_id):  # noqa: B007
        pass
    return final


def test_a_request_accepted_after_the_client_gave_up_is_aborted(engine):
    # Bug fixed in review: the add raced the submit deadline and the request ran to the end
    # with nobody reading it.
    slow = _SlowAdd(engine)
    async_llm = AsyncLLM(lambda: slow, submit_timeout_s=0.05)

    async def scenario():
        with pytest.raises(asyncio.TimeoutError):
            await async_llm.generate(PROMPT, LONG, "gave-up").__anext__()
        slow.release.set()
        return await asyncio.wait_for(_last(async_llm, PROMPT, SHORT, "next"), DEADLINE_S)

    try:
        final = asyncio.run(scenario())
        assert len(final.outputs[0].token_ids) == 2
        assert not engine._outputs.has("gave-up")
        assert async_llm.num_in_flight == 0
    finally:
        async_llm.shutdown(drain_timeout_s=0.0)


def test_a_refused_duplicate_id_does_not_abort_the_live_request(engine):
    async_llm = AsyncLLM(lambda: engine)

    async def scenario():
        live = async_llm.generate(PROMPT, MEDIUM, "same")
        first = await live.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await async_llm.generate(PROMPT, SHORT, "same").__anext__()
        rest = [output async for output in live]
        return [first, *rest]

    try:
        outputs = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
        assert outputs[-1].finished
        assert len(outputs[-1].outputs[0].token_ids) == 60
    finally:
        async_llm.shutdown(drain_timeout_s=0.0)


def test_a_failing_abort_does_not_stop_the_engine_loop(engine):
    # Bug fixed in review: the exception killed the engine thread and every other client
    # waited out output_timeout_s.
    flaky = _AbortFailsOnce(engine)
    async_llm = AsyncLLM(lambda: flaky, output_timeout_s=DEADLINE_S)

    async def scenario():
        kept = asyncio.ensure_future(_last(async_llm, PROMPT, MEDIUM, "kept"))
        dropped = async_llm.generate(PROMPT, LONG, "dropped")
        await dropped.__anext__()
        await dropped.aclose()
        return await kept

    try:
        final = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
        assert flaky.num_failed == 1
        assert len(final.outputs[0].token_ids) == 60
        assert async_llm.is_running
    finally:
        async_llm.shutdown(drain_timeout_s=0.0)


def test_the_engine_is_built_on_the_thread_that_runs_it(model_dir):
    # Built elsewhere, the builder's OpenMP team outlives the build and slows every op of the
    # engine's (kvtier/worker/cpu_threads.py).
    built_on = []

    def factory():
        built_on.append(threading.current_thread().name)
        return LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=128).engine

    async_llm = AsyncLLM(factory)
    try:
        final = asyncio.run(asyncio.wait_for(_last(async_llm, PROMPT, SHORT, "r"), DEADLINE_S))
        assert len(final.outputs[0].token_ids) == 2
        assert built_on == [async_llm._thread.name] != [threading.current_thread().name]
    finally:
        async_llm.shutdown(drain_timeout_s=0.0)


def _no_engine_thread_left() -> bool:
    deadline = time.monotonic() + DEADLINE_S
    while any(t.name == "kvtier-engine" and t.is_alive() for t in threading.enumerate()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_failing_build_raises_to_the_caller_and_ends_the_thread():
    def factory():
        raise ValueError("no such model: /nowhere")

    with pytest.raises(ValueError, match="no such model"):
        AsyncLLM(factory)
    assert _no_engine_thread_left()


class _ShutdownRecorder(_Wrapped):
    """The real engine, whose shutdown is only recorded (the fixture still checks it)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.shut_down = threading.Event()

    def shutdown(self) -> None:
        self.shut_down.set()


def test_a_build_past_the_startup_deadline_is_an_engine_startup_error(engine):
    release = threading.Event()
    late = _ShutdownRecorder(engine)

    def factory():
        release.wait(DEADLINE_S)
        return late

    with pytest.raises(EngineStartupError, match="not built within 0.05 s"):
        AsyncLLM(factory, startup_timeout_s=0.05)
    release.set()
    # Nobody holds the engine built after the caller gave up: the thread shuts it down.
    assert late.shut_down.wait(DEADLINE_S)
    assert _no_engine_thread_left()


class _StuckShutdown(_Wrapped):
    """The real engine, whose shutdown blocks until `release` (a tier stuck in I/O)."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.release = threading.Event()
        self.shut_down_on: list[str] = []

    def shutdown(self) -> None:
        self.shut_down_on.append(threading.current_thread().name)
        self.release.wait(DEADLINE_S)


def test_shutdown_stops_the_engine_on_its_thread_and_waits_only_until_the_deadline(engine):
    stuck = _StuckShutdown(engine)
    async_llm = AsyncLLM(lambda: stuck)
    final = asyncio.run(asyncio.wait_for(_last(async_llm, PROMPT, SHORT, "r"), DEADLINE_S))
    assert len(final.outputs[0].token_ids) == 2
    start = time.monotonic()
    async_llm.shutdown(drain_timeout_s=0.0, join_timeout_s=0.5)
    assert time.monotonic() - start < 0.5 + 5
    assert stuck.shut_down_on == ["kvtier-engine"]  # the only thread that touches the engine
    assert async_llm._thread.is_alive() and async_llm._thread.daemon  # abandoned, not joined
    stuck.release.set()
    assert _no_engine_thread_left()


def test_a_command_interrupts_the_engine_only_while_it_steps(engine):
    """An engine thread asleep on the command queue takes a new request itself; interrupting it
    would only end its next idle wait early (a disk hit's promotions then took a step more).
    While it steps, every command interrupts, so a wait for transfers never delays one."""
    counting = _CountsInterrupts(engine)
    async_llm = AsyncLLM(lambda: counting)

    async def scenario():
        for index in range(3):
            deadline = time.monotonic() + DEADLINE_S
            while not async_llm._waiting_for_commands:
                assert time.monotonic() < deadline, "the engine thread never went idle"
                await asyncio.sleep(0.001)
            await _last(async_llm, PROMPT, SHORT, f"idle-{index}")
        idle_interrupts = counting.num_interrupts
        running = async_llm.generate(PROMPT, LONG, "running")
        await running.__anext__()  # stepping now: the next add interrupts
        before = counting.num_interrupts
        await _last(async_llm, PROMPT, SHORT, "while-stepping")
        stepping_interrupts = counting.num_interrupts - before
        await running.aclose()
        return idle_interrupts, stepping_interrupts

    try:
        assert asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S)) == (0, 1)
    finally:
        async_llm.shutdown(drain_timeout_s=0.0)


def test_a_slow_reader_holds_the_latest_output_not_every_steps(engine):
    """Outputs are cumulative: a client that stops reading while its request runs on finds
    the latest one, not a backlog of one per step."""
    async_llm = AsyncLLM(lambda: engine)

    async def scenario():
        stream = async_llm.generate(PROMPT, MEDIUM, "slow")
        first = await stream.__anext__()
        deadline = time.monotonic() + DEADLINE_S
        while async_llm.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the engine finishes it meanwhile
        rest = [output async for output in stream]
        return first, rest

    try:
        first, rest = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
        assert len(first.outputs[0].token_ids) < 60
        assert len(rest) == 1 and rest[0].finished
        assert len(rest[0].outputs[0].token_ids) == 60
    finally:
        async_llm.shutdown(drain_timeout_s=0.0)


class _LoopDiesInStep(_Wrapped):
    """The real engine, whose first step waits for `release`; then the loop's next look at
    the engine raises outside any step (as a bug in the loop would), ending the loop."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.entered = threading.Event()
        self.release = threading.Event()

    def step(self):
        self.entered.set()
        assert self.release.wait(DEADLINE_S)
        return self._engine.step()

    def has_unfinished_requests(self) -> bool:
        if self.release.is_set():
            raise RuntimeError("the engine loop broke")
        return self._engine.has_unfinished_requests()


def test_an_add_queued_as_the_loop_dies_is_refused_at_once(engine):
    dying = _LoopDiesInStep(engine)
    async_llm = AsyncLLM(lambda: dying, submit_timeout_s=DEADLINE_S)

    async def scenario():
        running = asyncio.ensure_future(_last(async_llm, PROMPT, SHORT, "running"))
        await asyncio.to_thread(dying.entered.wait, DEADLINE_S)
        queued = asyncio.ensure_future(_last(async_llm, PROMPT, SHORT, "queued"))
        await asyncio.sleep(0.05)  # its add is on the queue, behind the dying step
        dying.release.set()
        started = time.monotonic()
        results = await asyncio.gather(running, queued, return_exceptions=True)
        return results, time.monotonic() - started

    try:
        (running, queued), waited = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
        assert isinstance(running, EngineDeadError) and isinstance(queued, EngineDeadError)
        assert waited < DEADLINE_S / 2  # not the submit deadline
    finally:
        async_llm.shutdown(drain_timeout_s=0.0)
