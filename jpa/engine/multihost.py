"""Several processes (hosts), one engine: multi-controller lockstep on `jax.distributed`.

With tensor parallelism over several processes (`EngineConfig.tensor_parallel` = every device of
every process), each process must run the same compiled programs, in the same order, on the same
inputs: that is how JAX's multi-controller SPMD works. jpa keeps the host side in ONE place:

- process 0 (the leader) owns everything above the device: the request queue, the scheduler, the
  prefix cache's index, detokenization, stop strings, grammars, the server. Its ModelRunner is
  wrapped by `Leader`, which sends every device call it makes (`step` with its StepBatch,
  `retire`, `uncache`) to the other processes before making it;
- every other process (a follower) builds the same engine (same model, same EngineConfig) and
  calls `LLMEngine.follow()`: it receives each call and makes it on its own runner, so its
  devices take part in the same collectives. Outputs are read on process 0 (they are
  replicated, so reading them needs no communication).

The messages go through the coordination service that `jax.distributed` already runs (its
key-value store, in process 0): numpy archives (`np.savez`; read back with allow_pickle=False,
so a message can only ever be arrays, never code) under "jpa/m/<n>", no extra port and no extra
dependency. A message is deleted once every follower has provably read it (after the
next unified step, whose collectives need every process, completes on the leader).

Failures. A device call that fails (a collective whose peer died: "Gloo ... Connection reset by
peer") ends the process with one line: the processes can no longer run in lockstep. A process
that hangs (stopped, or alive but not taking part) would leave the others waiting inside a
collective forever; a `Watchdog` around every device call ends such a process after
`peer_timeout` seconds with one clear line. A follower that loses process 0 while waiting for its
next call says so and exits. Backstop: JAX's coordination service ends every process of the job
when one stops sending heartbeats for 2 x peer_timeout (`initialize`). Compilation is outside the
watchdog: every process compiles, then they meet at a barrier (a big model compiles for minutes,
which must not count as a hang).
"""

import io
import os
import sys
import threading
import time

import jax
import numpy as np

KEY = "jpa/m/"             # message n is KEY + str(n)
COMPILE_BARRIER = "jpa/compiled/"


def initialize(coordinator: str, num_processes: int, process_id: int, *, peer_timeout: float = 60.0,
               join_timeout: float = 300.0) -> None:
    """`jax.distributed.initialize` with jpa's failure timeouts (call before JAX starts a backend).

    Args:
      coordinator: "HOST:PORT" of process 0 (it runs the coordination service there).
      num_processes, process_id: this job's size and this process's index.
      peer_timeout: the watchdog's limit on a device call (see `Watchdog`); JAX's heartbeat timeout
        (a process that stopped beating counts as dead and the job ends) and its shutdown barrier's
        limit are twice that.
      join_timeout: seconds to wait for every process to join.
    """
    # JAX's own heartbeat check is the backstop (a process stopped while nobody waits on it); at twice
    # the watchdog's limit, so that a hang inside a device call is reported by jpa's one clear line.
    t = max(1, int(round(2 * peer_timeout)))
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=max(1, int(round(join_timeout))),
                               heartbeat_timeout_seconds=t, shutdown_timeout_seconds=t)


def _client():
    from jax._src.distributed import global_state   # the coordination service's client (jax.distributed)

    if global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized: call jpa.engine.multihost.initialize (or "
                           "jax.distributed.initialize) before creating a multi-process engine")
    return global_state.client


def _pack(op: str, arrays) -> bytes:
    """A message: the operation's name and its arrays (a numpy archive: no pickled objects)."""
    buf = io.BytesIO()
    np.savez(buf, op=np.asarray(op), **{f"a{i}": np.asarray(a) for i, a in enumerate(arrays)})
    return buf.getvalue()


def _unpack(data: bytes) -> tuple[str, list]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return str(z["op"]), [z[f"a{i}"] for i in range(len(z.files) - 1)]


def _die(message: str) -> None:
    """Ends this process at once with one clear line (a peer is gone: nothing can be saved)."""
    sys.stderr.write(f"[jpa] process {jax.process_index()} of {jax.process_count()}: {message}\n")
    sys.stderr.flush()
    os._exit(1)


class Watchdog:
    """Ends the process when a guarded call has not returned within `timeout` seconds."""

    def __init__(self, timeout: float):
        self.timeout = float(timeout)
        self._what, self._since = None, 0.0
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="jpa-watchdog", daemon=True).start()

    def _watch(self):
        while True:
            time.sleep(min(0.5, self.timeout / 4))
            with self._lock:
                what, since = self._what, self._since
            if what is not None and time.monotonic() - since > self.timeout:
                _die(f"{what} has not finished in {self.timeout:g} s: another process of the job is dead or "
                     f"hung (peer timeout {self.timeout:g} s); exiting")

    def __call__(self, what: str, fn, *args):
        with self._lock:
            self._what, self._since = what, time.monotonic()
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._what = None


class _Lockstep:
    """What leader and followers share: the runner, the watchdog, and the compile barrier."""

    def __init__(self, runner, peer_timeout: float, compile_timeout: float):
        self.runner, self.client = runner, _client()
        self.watchdog = Watchdog(peer_timeout)
        self.compile_timeout = compile_timeout
        self._compiles = 0

    def _call(self, op: str, args: tuple):
        if op == "step" and self.runner.compiled_step is None:
            self.runner.compile_step(args[0].rows.tokens.shape[0])
            # Every process compiled: only then do the collectives start (a slow compile is no hang).
            self.client.wait_at_barrier(f"{COMPILE_BARRIER}{self._compiles}", int(self.compile_timeout * 1000))
            self._compiles += 1
        try:
            return self.watchdog(f"the device call {op!r}", getattr(self.runner, op), *args)
        except Exception as e:   # e.g. a collective whose peer is gone: the processes can no longer agree
            _die(f"the device call {op!r} failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:300]}); "
                 f"the processes of the job can no longer run in lockstep, so this one exits")


class Leader(_Lockstep):
    """Process 0's ModelRunner: every device call is sent to the followers, then made here.

    Everything else (attributes such as compile_seconds, page_state, attention) reads the
    wrapped runner.
    """

    def __init__(self, runner, *, peer_timeout: float = 60.0, compile_timeout: float = 3600.0):
        super().__init__(runner, peer_timeout, compile_timeout)
        self._sent = 0          # messages sent
        self._kept = 0          # the oldest message not deleted yet
        self.closed = False

    def __getattr__(self, name):   # attributes not defined here: the runner's
        return getattr(self.runner, name)

    def _send(self, op: str, arrays) -> int:
        if self.closed:
            raise RuntimeError("this multi-process engine was closed: its followers have stopped")
        n = self._sent
        self.client.key_value_set_bytes(f"{KEY}{n}", _pack(op, arrays))
        self._sent += 1
        return n

    def _forget(self, upto: int) -> None:
        """Deletes messages before `upto`: every follower has read them."""
        for n in range(self._kept, upto):
            self.client.key_value_delete(f"{KEY}{n}")
        self._kept = max(self._kept, upto)

    def step(self, batch):
        n = self._send("step", jax.tree_util.tree_leaves(batch))
        result = self._call("step", (batch,))
        # The step's collectives needed every process: each has read message n and all before it.
        self._forget(n)
        return result

    def retire(self, seq_ids):
        self._send("retire", [np.asarray(list(seq_ids), np.int32)])
        return self._call("retire", (list(seq_ids),))

    def uncache(self, page_ids):
        self._send("uncache", [np.asarray(list(page_ids), np.int32)])
        return self._call("uncache", (list(page_ids),))

    def close(self, ok: bool = True) -> None:
        """Tells the followers to return from follow() (idempotent)."""
        if not self.closed:
            self._send("stop", [np.asarray(bool(ok))])
            self.closed = True


class Follower(_Lockstep):
    """A process other than 0: makes the leader's device calls on its own runner, in order."""

    def __init__(self, runner, *, peer_timeout: float = 60.0, compile_timeout: float = 3600.0):
        super().__init__(runner, peer_timeout, compile_timeout)
        self.calls = 0
        self._batch = jax.tree_util.tree_structure(runner.step_inputs(1))   # a StepBatch's pytree structure

    def run(self) -> bool:
        """Follows until the leader closes; returns the leader's `ok` (False: it stopped on an error).

        Waits for messages without a limit (an idle server sends none); the leader's death ends
        this process through JAX's coordination service (it lives in process 0).
        """
        n = 0
        while True:
            try:   # one second at a time, so that a signal (SIGTERM, Ctrl-C) is handled between waits
                data = self.client.blocking_key_value_get_bytes(f"{KEY}{n}", 1000)
            except Exception as e:  # the wait ran out (an idle leader): wait again; anything else is fatal
                if "DEADLINE_EXCEEDED" in str(e):
                    continue
                _die(f"lost process 0 (the leader) while waiting for its next call: {e}")
            op, arrays = _unpack(data)
            n += 1
            if op == "stop":
                return bool(arrays[0])
            if op == "step":
                args = (jax.tree_util.tree_unflatten(self._batch, arrays),)
            elif op in ("retire", "uncache"):
                args = (arrays[0].tolist(),)
            else:
                _die(f"process 0 sent an unknown call {op!r} (are all processes running the same jpa?)")
            self._call(op, args)
            self.calls += 1
