"""The step-shape ladder: compiled unified steps sized to the live batch, not to the engine's maximum.

The unified step (`jpa.engine.runner`) computes B entries of its ragged pass, a token budget T,
and B rows of every decode step, whatever is live; at one user of max_seqs = 32 a decode step
costs 32 rows. The ladder (`jpa.engine.shapes.step_ladder`, `EngineConfig.step_shapes`) is a
short list of shapes (`StepShape`: rows B, tokens T); each round runs the smallest compiled
shape that holds its work (`Ladder.pick`): rows for every slot holding a request, tokens for its
prompt chunks and decode rows. Below max_seqs rows the decode loop runs on the slots the host
names (`StepBatch.loop_slots`): their per-slot state is gathered out of the max_seqs slots
(`gather_slots`), the loop runs on it, and it is scattered back (`scatter_slots`); at max_seqs rows
the loop runs every slot, the program of an engine without a ladder.

Every shape keeps the step's guarantees: one program per shape (counted), the cache, page state
and slots donated and aliased, outputs equal to the full shape's (tests/test_step_ladder.py).

The full shape compiles first (a cold start waits for nothing more than an engine without the
ladder); the other shapes compile afterwards in a background thread, smallest first (`Ladder.start`),
and land in JAX's persistent compilation cache where it is on (`jpa generate` / `jpa serve`), so a
warm start loads them. Until a shape is ready, rounds run on the smallest ready one that holds
them (the full shape at worst).
"""

import atexit
import os
import threading
import time
import weakref

import jax
import jax.numpy as jnp

from jpa.engine.batch import Sampled, SpecCounts
from jpa.engine.shapes import StepShape


def gather_slots(page_state, slots, idx):
    """(page_state, slots) of the slots idx i32[R] (-1 = padding: an idle row with no pages), as
    the decode loop reads them: per-slot fields [R], the pool-wide ones (free list, refcounts,
    cached pages, page tokens) whole."""
    live = idx >= 0
    safe = jnp.where(live, idx, 0)
    ps = page_state.replace(block_tables=jnp.where(live[:, None], page_state.block_tables[safe], 0),
                            seq_lens=jnp.where(live, page_state.seq_lens[safe], 0))
    sub = slots.rows(safe)
    return ps, sub.replace(active=sub.active & live)


def scatter_slots(page_state, slots, sub_ps, sub_slots, idx):
    """(page_state, slots) over every slot after the loop ran on `gather_slots(page_state, slots, idx)`:
    the pool-wide fields from the loop's (sub_ps, sub_slots), the per-slot ones written back at idx
    (padding dropped); slots not in idx are as they were (the loop never runs an idle slot)."""
    drop = jnp.where(idx >= 0, idx, slots.active.shape[0])
    put = lambda full, part: full.at[drop].set(part, mode="drop")  # noqa: E731
    ps = sub_ps.replace(block_tables=put(page_state.block_tables, sub_ps.block_tables),
                        seq_lens=put(page_state.seq_lens, sub_ps.seq_lens))
    per = jax.tree_util.tree_map(put, slots.replace(page_tokens=None), sub_slots.replace(page_tokens=None))
    return ps, per.replace(page_tokens=sub_slots.page_tokens)


def scatter_outputs(out: Sampled, counts: SpecCounts, idx, max_seqs: int):
    """The loop's per-row outputs (`Sampled` [steps * width, R], `SpecCounts` [R]) as [.., max_seqs]
    (rows of other slots: no token, as the full shape leaves idle slots)."""
    drop = jnp.where(idx >= 0, idx, max_seqs)

    def put(a, fill):
        full = jnp.full(a.shape[:1] + (max_seqs,) + a.shape[2:], fill, a.dtype)
        return full.at[:, drop].set(a, mode="drop")

    out = Sampled(put(out.tokens, -1), put(out.logprobs, 0), put(out.top_ids, -1), put(out.top_logprobs, -jnp.inf))
    z = lambda a: jnp.zeros((max_seqs,), a.dtype).at[drop].set(a, mode="drop")  # noqa: E731
    return out, SpecCounts(z(counts.drafted), z(counts.accepted), z(counts.steps), counts.accepted_per_pos)


# The ladder thread's niceness: its compiles yield the cores to the engine's rounds.
LADDER_NICE = 10


class Ladder:
    """The compiled shapes of one runner, and the thread that compiles them ahead of need.

    Args:
      shapes: the ladder, smallest first, the full shape last (`step_ladder`).
      compile: compile(shape) -> the executable (the runner's, under its lock).
    """

    def __init__(self, shapes: tuple[StepShape, ...], compile):
        self.shapes = tuple(shapes)
        self._compile = compile
        self.exes: dict[StepShape, object] = {}
        self.lock = threading.RLock()
        self.background_compiles = 0      # shapes the thread compiled (or loaded from a cache)
        self.background_seconds = 0.0     # its wall time doing so
        self._thread = None
        self._stop = threading.Event()
        self.error = None   # why the thread stopped early, if it did

    @property
    def full(self) -> StepShape:
        return self.shapes[-1]

    def pick(self, rows: int, tokens: int) -> StepShape:
        """The smallest ready shape that holds a round of `rows` entries / held slots and `tokens`
        rows; the full shape when none is ready (it compiles at its first use)."""
        return next((s for s in self.shapes if s in self.exes and s.holds(rows, tokens)), self.full)

    def get(self, shape: StepShape):
        """The executable of `shape`, compiled now if the thread has not yet (waiting for it if it is
        compiling that shape)."""
        exe = self.exes.get(shape)
        if exe is None:
            with self.lock:
                exe = self.exes.get(shape)
                if exe is None:
                    exe = self.exes[shape] = self._compile(shape)
        return exe

    def start(self) -> None:
        """Compiles every shape not compiled yet in a background thread, smallest first."""
        if self._thread is not None or all(s in self.exes for s in self.shapes):
            return
        self._thread = threading.Thread(target=self._run, name="jpa-step-ladder", daemon=True)
        self._thread.start()
        # At exit, the thread finishes the shape it compiles first (a compiler torn down under it
        # could crash the exit).
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().stop())

    def _run(self) -> None:
        try:   # below the rounds in the OS scheduler (Linux: per thread; the compiler's threads inherit it)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LADDER_NICE)
        except (AttributeError, OSError):
            pass
        for shape in self.shapes:
            if self._stop.is_set():
                return
            with self.lock:
                if shape in self.exes:
                    continue
                t0 = time.perf_counter()
                try:
                    self.exes[shape] = self._compile(shape, background=True)
                except Exception as e:   # the shape stays unready: rounds use a larger one
                    self.error = f"{shape}: {type(e).__name__}: {e}"
                    return
                self.background_seconds += time.perf_counter() - t0
                self.background_compiles += 1

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the thread to compile every shape; True when all are ready."""
        if self._thread is not None:
            self._thread.join(timeout)
        return all(s in self.exes for s in self.shapes)

    def stop(self) -> None:
        """Stops the thread after the shape it is compiling (an engine closing, the process exiting)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
