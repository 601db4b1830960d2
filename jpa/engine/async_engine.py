"""AsyncEngine: an always-running LLMEngine on its own thread, for servers.

LLMEngine is not thread-safe, so one thread (the engine thread) owns it and is the only caller of
add_request / abort / step. Everyone else talks to it through a command list (add, abort), guarded
by a condition variable, and reads results from per-request asyncio queues that the engine thread
fills with `loop.call_soon_threadsafe`. The loop:

    while True:
        sleep on the condition while there is no command and no unfinished request (idle)
        apply the commands: add_request / abort (the next step releases an aborted request's pages first)
        step() once if anything is unfinished; hand each StepOutput to its request's queue
        publish a Snapshot (running, waiting, pages, rounds, tokens/s) for metrics

So an abort that arrives while a round runs is applied right after that round, before the next
one: its pages are back within one round.

RL rollouts (vLLM's names): `update_weights(weights)` runs `LLMEngine.update_weights` on the engine
thread between two rounds and returns the new version. `pause_generation(mode)` stops the rounds:
"abort" aborts every request in flight, "wait" lets them finish, "keep" stops at once with their
slots and KV kept (after `resume_generation()` they go on, with whatever weights are served then,
each token's version reported). Requests submitted while paused are accepted and wait for the resume. There is one scheduler, the LLMEngine's; the offline
`LLMEngine.generate()` is the same add_request/step loop run inline.

Backpressure: at most `max_waiting` requests wait (accepted, not yet running) at once; a
submission beyond that raises EngineOverloaded at once, and nothing of it is queued.
"""

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
import traceback

from jpa.engine.engine import LLMEngine
from jpa.engine.request import RequestOutput, StepOutput
from jpa.engine.sampling import SamplingParams

log = logging.getLogger("jpa.engine")


PAUSE_MODES = ("abort", "wait", "keep")


class EngineOverloaded(Exception):
    """The waiting queue is full: try again later (a server answers 503 with Retry-After)."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class EngineDead(RuntimeError):
    """The engine thread stopped (shut down, or failed in a way it could not recover from)."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The engine's state after its latest loop iteration (read from any thread).

    Attributes:
      num_running: requests holding a slot.
      num_waiting: accepted requests not running yet (the engine's queue + commands not applied).
      num_pages / pages_used: the KV pool, read back from the device after every call; pages_used
        are those requests hold.
      cached_pages: pages the prefix cache alone holds (cached-idle: free once evicted).
      rounds: step() calls so far.
      prompt_tokens / generation_tokens: totals over finished and running requests.
      tokens_per_s: generated tokens per second over the last `rate_window` seconds.
      pool_whole: when idle (nothing unfinished): True if every page is free or held by the
        prefix cache alone (checked on the device); None while requests are unfinished.
      last_abort_rounds: rounds that ran between the latest abort's arrival and the release of
        its pages (0 or 1: aborts are applied before the next round, whose step releases their
        pages first); -1 before any abort.
      alive: the engine thread is running.
      compilations / compile_seconds: programs the engine compiled so far (its one program, the
        unified step: 1 once it ran) and the time it took.
      paused: generation is paused (`AsyncEngine.pause_generation`): no round runs.
      weight_version: the weights served (`update_weights`: 0 until the first update).
    """
    num_running: int = 0
    num_waiting: int = 0
    num_pages: int = 0
    pages_used: int = 0
    cached_pages: int = 0
    rounds: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    tokens_per_s: float = 0.0
    pool_whole: bool | None = True
    last_abort_rounds: int = -1
    alive: bool = False
    compilations: int = 0
    compile_seconds: float = 0.0
    paused: bool = False
    weight_version: int = 0


@dataclasses.dataclass
class _Stream:
    """Where one request's outputs go: a group's queue, tagged with the request's index in it."""
    group: "RequestGroup"
    index: int


def _num_samples(params) -> int:
    return getattr(params, "n", 1) if params is not None else 1


class RequestGroup:
    """The outputs of requests submitted together (a completion with n choices, or a prompt list).

    Iterate it (`async for index, out in group`) to get (index in the submission, StepOutput) in
    the order the engine produced them, until every request has finished; each request's last
    StepOutput has finished=True and its RequestOutput. `abort()` (or leaving an `async with`
    block early) cancels the unfinished ones.

    Attributes:
      request_ids: engine request ids, in submission order.
      arrival: time.monotonic() of the submission.
    """

    def __init__(self, engine: "AsyncEngine", request_ids: list, loop: asyncio.AbstractEventLoop):
        self._engine, self.request_ids, self._loop = engine, list(request_ids), loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))
        self.arrival = time.monotonic()

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    @property
    def num_unfinished(self) -> int:
        """Requests of the group that have not finished (0 after abort())."""
        return len(self._unfinished)

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, StepOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        index, out = item
        if out.finished:
            self._unfinished.discard(index)
        return index, out

    def abort(self) -> None:
        """Cancels the requests of this group that have not finished (thread-safe, idempotent)."""
        for i in list(self._unfinished):
            self._engine.abort(self.request_ids[i])
        self._unfinished.clear()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.abort()

    def _put(self, item) -> None:
        """Engine thread -> event loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass


class AsyncEngine:
    """Runs an LLMEngine on a background thread; submit and abort from any thread or event loop.

    Args:
      engine: the LLMEngine to own (do not call it from elsewhere once started).
      max_waiting: most requests that may wait (accepted, not running) before new submissions
        raise EngineOverloaded.
      rate_window: seconds over which Snapshot.tokens_per_s is measured.

    Use as a context manager, or call start() and shutdown().
    """

    def __init__(self, engine: LLMEngine, *, max_waiting: int = 256, rate_window: float = 10.0):
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an int >= 1; got {max_waiting!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.rate_window = rate_window
        self._cv = threading.Condition()
        self._commands: list[tuple] = []         # ("add", id, prompt, params, lora), ("abort", id, round), ("call", fn, fut)
        self._streams: dict[object, _Stream] = {}   # unfinished request id -> where its outputs go
        self._num_running = 0                    # as of the latest round (for the overload check)
        self._stopping = False
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._rounds = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._rate = collections.deque()          # (monotonic time, generation_tokens) per round
        self._last_abort_rounds = -1
        self._pause: str | None = None     # pause_generation's mode while paused or pausing
        self._paused = False               # the engine thread runs no round (acknowledged)
        self._held: list[tuple] = []       # submissions while paused: applied at the resume
        self.snapshot = Snapshot(num_pages=engine.num_pages)

    # ------------------------------------------------------------------ life cycle

    def start(self) -> "AsyncEngine":
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start: already started")
        self._thread = threading.Thread(target=self._run, name="jpa-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops the thread; unfinished requests end with finish_reason "abort"."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.shutdown()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def stop_ids(self) -> frozenset:
        return self.engine.stop_ids

    # ------------------------------------------------------------------ requests

    def submit(self, requests, *, loop: asyncio.AbstractEventLoop | None = None) -> RequestGroup:
        """Queues requests together: all of them, or (overloaded) none.

        Args:
          requests: list of (prompt, SamplingParams) or (prompt, SamplingParams, LoRARequest | None)
            (prompt: str or list of token ids; the LoRA adapter to run it with, `LLMEngine.add_request`).
            A request with SamplingParams.n > 1 is n entries of the group (its samples, in order),
            computed from one prefill on shared pages (`LLMEngine` parallel sampling).
          loop: the event loop that will iterate the group (default: the running loop).

        Returns:
          A RequestGroup streaming their outputs.

        Raises:
          EngineOverloaded: fewer than len(requests) places are left in the waiting queue.
          EngineDead: the engine thread is not running.
        """
        loop = loop or asyncio.get_running_loop()
        requests = [tuple(r) if len(r) == 3 else (*r, None) for r in requests]
        with self._cv:
            if not self.alive or self._stopping:
                raise EngineDead(f"the engine is not running{f': {self._dead}' if self._dead else ''}")
            waiting = len(self._streams) - self._num_running
            count = sum(_num_samples(params) for _, params, _ in requests)
            if waiting + count > self.max_waiting:
                raise EngineOverloaded(f"the server is overloaded: {waiting} requests are waiting (at most "
                                       f"{self.max_waiting}); try again later")
            rids = [f"r{next(self._ids)}" for _ in requests]
            # One stream per sample: a request with n > 1 comes out of the engine as (rid, i).
            ids = [rid if _num_samples(params) == 1 else (rid, i)
                   for rid, (_, params, _) in zip(rids, requests) for i in range(_num_samples(params))]
            group = RequestGroup(self, ids, loop)
            for i, sid in enumerate(ids):
                self._streams[sid] = _Stream(group, i)
            queue = self._held if self._pause is not None else self._commands   # paused: they wait for resume
            for rid, (prompt, params, lora) in zip(rids, requests):
                queue.append(("add", rid, prompt, params, lora))
            self._cv.notify()
        return group

    def abort(self, request_id) -> None:
        """Cancels a request (thread-safe; unknown or finished ids are ignored). It is applied
        before the engine's next round, which releases its pages."""
        with self._cv:
            if request_id in self._streams:
                self._commands.append(("abort", request_id, self._rounds))
                self._cv.notify()

    # ------------------------------------------------------------------ RL: weights, pause and resume

    def update_weights(self, weights, timeout: float | None = None) -> int:
        """`LLMEngine.update_weights(weights)` on the engine thread, between two rounds (thread-safe;
        blocks until done). Returns the new weight version; raises its ValueError (nothing changed)."""
        return self.call(lambda eng: eng.update_weights(weights), timeout)

    def call(self, fn, timeout: float | None = None):
        """fn(the LLMEngine) on the engine thread, between two rounds (thread-safe; blocks until done):
        e.g. loading or unloading a LoRA adapter (`LLMEngine.load_lora` / `unload_lora`). Returns what fn
        returns; raises what it raises."""
        future = concurrent.futures.Future()
        with self._cv:
            if not self.alive or self._stopping:
                raise EngineDead(f"the engine is not running{f': {self._dead}' if self._dead else ''}")
            self._commands.append(("call", fn, future))
            self._cv.notify()
        return future.result(timeout)

    def pause_generation(self, mode: str = "abort", timeout: float | None = None) -> None:
        """Stops generation (thread-safe; returns once no round runs). Requests submitted meanwhile
        wait for `resume_generation`.

        Args:
          mode: "abort": requests in flight end now with finish_reason "abort"; "wait": they run to
            the end first; "keep": they stop where they are, keeping their slots and KV, and go on
            after the resume (with the weights served then).
          timeout: seconds to wait for the pause ("wait" waits for requests to finish); None: no limit.

        Raises:
          ValueError: an unknown mode. TimeoutError: not paused within `timeout` (it pauses still).
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation: mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        with self._cv:
            if not self.alive or self._stopping:
                raise EngineDead(f"the engine is not running{f': {self._dead}' if self._dead else ''}")
            if not (self._paused and self._pause == mode):
                self._pause, self._paused = mode, False
            if mode == "abort":   # everything accepted before the pause (not what waits for the resume)
                held = {c[1] for c in self._held}
                self._commands += [("abort", rid, self._rounds) for rid in self._streams
                                   if (rid[0] if isinstance(rid, tuple) else rid) not in held]
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: self._paused or not self.alive, timeout):
                raise TimeoutError(f"pause_generation(mode={mode!r}): requests still running after {timeout} s")

    def resume_generation(self) -> None:
        """Ends a pause (thread-safe; a no-op when not paused): rounds run again, requests submitted
        while paused are queued in the order they came."""
        with self._cv:
            self._pause, self._paused = None, False
            self._commands += self._held
            self._held = []
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        """Generation is paused (or pausing)."""
        return self._pause is not None

    def _may_step(self) -> bool:
        """Rounds may run: not paused, or pausing with "wait" / "abort" (draining what is in flight)."""
        return self._pause in (None, "wait", "abort")

    def _settle_pause(self) -> None:
        """Marks the pause reached when nothing may run any more (engine thread): every command that came
        before the pause applied (a request accepted then is in flight), and with "wait" / "abort" every
        request finished."""
        with self._cv:
            if self._pause is not None and not self._paused and not self._commands and (
                    self._pause == "keep" or not self.engine.has_unfinished):
                self._paused = True
                self._cv.notify_all()

    async def generate(self, prompt, params: SamplingParams | None = None) -> RequestOutput:
        """Runs one request to completion (aborted if the caller is cancelled)."""
        async with self.submit([(prompt, params or SamplingParams())]) as group:
            async for _, out in group:
                if out.finished:
                    return out.output
        raise EngineDead("the request ended without a result")

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        eng = self.engine
        self._publish()
        while True:
            with self._cv:
                while not self._commands and not (eng.has_unfinished and self._may_step()) \
                        and not self._stopping and (self._pause is None or self._paused):
                    self._cv.wait()  # idle (or paused): nothing to do until a command arrives
                commands, self._commands = self._commands, []
                stopping = self._stopping
            try:
                for cmd in commands:
                    self._apply(cmd)
                if stopping:
                    for rid in list(self._streams):
                        eng.abort(rid)
                if eng.has_unfinished and self._may_step():
                    outputs = eng.step()
                    self._rounds += 1
                    self._count(outputs)
                    self._publish()   # before the outputs go out: whoever saw a token sees this state
                    self._dispatch(outputs)
                else:
                    self._publish()
            except Exception as e:  # a bug in a round: fail what is in flight, keep serving if we can
                self._recover(e)
            self._settle_pause()
            if stopping or self._dead is not None:
                break
        self._fail_all(EngineDead("the engine shut down"))
        self._publish()

    def _apply(self, cmd) -> None:
        eng = self.engine
        if cmd[0] == "call":
            _, fn, future = cmd
            try:
                future.set_result(fn(eng))
            except Exception as e:   # the caller's error (a bad tensor or adapter): the engine is unchanged
                future.set_exception(e)
            self._publish()
        elif cmd[0] == "add":
            _, rid, prompt, params, lora = cmd
            req = eng.add_request(prompt, params, request_id=rid, lora_request=lora)
            self._prompt_tokens += len(req.prompt_ids)
        else:
            _, rid, at_round = cmd
            if eng.abort(rid):
                self._last_abort_rounds = self._rounds - at_round

    def _count(self, outputs: list[StepOutput]) -> None:
        now = time.monotonic()
        self._generation_tokens += sum(len(out.new_token_ids) for out in outputs)
        self._rate.append((now, self._generation_tokens))
        while self._rate and now - self._rate[0][0] > self.rate_window:
            self._rate.popleft()

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            with self._cv:
                rid = out.request_id
                if rid not in self._streams and (rid, 0) in self._streams:
                    # A request with n samples that failed before it was split: each sample fails.
                    targets = []
                    i = 0
                    while (rid, i) in self._streams:
                        targets.append((dataclasses.replace(out, request_id=(rid, i)), self._streams.pop((rid, i))))
                        i += 1
                else:
                    stream = self._streams.pop(rid, None) if out.finished else self._streams.get(rid)
                    targets = [] if stream is None else [(out, stream)]
            for o, stream in targets:
                stream.group._put((stream.index, o))

    def _publish(self) -> None:
        eng = self.engine
        idle = not eng.has_unfinished
        rate = 0.0
        if len(self._rate) >= 2 and not idle:
            (t0, n0), (t1, n1) = self._rate[0], self._rate[-1]
            rate = (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
        with self._cv:
            self._num_running = eng.num_running
            queued = sum(1 for c in self._commands if c[0] == "add")
        self.snapshot = Snapshot(
            num_running=eng.num_running, num_waiting=eng.num_waiting + queued, num_pages=eng.num_pages,
            pages_used=eng.pages_in_use, cached_pages=eng.num_cached_idle, rounds=self._rounds,
            prompt_tokens=self._prompt_tokens, generation_tokens=self._generation_tokens, tokens_per_s=rate,
            pool_whole=eng.pool_is_whole() if idle else None, last_abort_rounds=self._last_abort_rounds,
            alive=self.alive and not self._stopping,
            compilations=eng.runner.compiles,
            compile_seconds=eng.runner.compile_seconds, paused=self._pause is not None,
            weight_version=eng.weight_version)

    def _recover(self, e: Exception) -> None:
        log.error("engine round failed; failing the requests in flight:\n%s", traceback.format_exc())
        with self._cv:
            in_flight = list(self._streams)
        self._fail_all(RuntimeError(f"internal engine error: {e}"))
        try:  # take them out of the engine too, so their pages come back
            for rid in in_flight:
                self.engine.abort(rid)
            while self.engine.has_unfinished:
                self.engine.step()
            self._publish()
        except Exception as e2:
            log.error("the engine could not recover: %s", e2)
            self._dead = e2

    def _fail_all(self, error: BaseException) -> None:
        with self._cv:
            streams, self._streams = list(self._streams.values()), {}
            updates = [c[2] for c in self._commands if c[0] == "call"]
            self._commands = [c for c in self._commands if c[0] not in ("add", "call")]
            self._held = []
        for future in updates:
            future.set_exception(EngineDead(f"the engine stopped before the weight update (or call): {error}"))
        for group in {id(s.group): s.group for s in streams}.values():
            group._put(error)
