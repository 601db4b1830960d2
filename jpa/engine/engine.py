"""LLMEngine: continuous batching on the host around the jitted device loop.

Per round: admit waiting requests into free slots while the page pool can hold their prompts plus
a watermark (one prefill call), then run up to `steps_per_call` decode steps on the device (one
call), then read back the new tokens: finished requests have already released their pages on the
device, and their slots are refilled from the queue next round. When the pool runs out mid-decode
the newest running request is preempted by recompute: its pages are released and it goes back to
the front of the queue with its generated tokens kept; on re-admission its prompt and generated
tokens are prefilled again and decoding resumes where it stopped.
"""

import collections
import dataclasses
import math
import sys
import time

import numpy as np

from jpa.cache import CacheConfig
from jpa.engine.request import Request, RequestOutput, Status
from jpa.engine.runner import ModelRunner, RowParams
from jpa.engine.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizes and policies (hashable).

    Attributes:
      max_seqs: decode slots (sequences decoded together).
      page_size: tokens per KV page.
      num_pages: pages in the pool; if None, derived from kv_memory_bytes.
      kv_memory_bytes: KV cache budget used when num_pages is None.
      max_model_len: longest sequence (prompt + completion); None = the model's max_seq_len.
      steps_per_call: decode steps per host round trip.
      watermark: fraction of the pool kept free at admission (vLLM's watermark), so running
        requests can grow before anyone is preempted.
      max_prefill_tokens: padded tokens (rows x width) per prefill call.
      cache_dtype: KV cache dtype; None = the model's dtype.
    """
    max_seqs: int = 16
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_bytes: int = 256 * 2 ** 20
    max_model_len: int | None = None
    steps_per_call: int = 8
    watermark: float = 0.01
    max_prefill_tokens: int = 2048
    cache_dtype: str | None = None

    def __post_init__(self):
        for name in ("max_seqs", "page_size", "steps_per_call", "max_prefill_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1; got {v!r}")
        for name in ("num_pages", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"EngineConfig.{name} must be an int >= 1 or None; got {v!r}")
        if self.num_pages is None and (not isinstance(self.kv_memory_bytes, int) or self.kv_memory_bytes < 1):
            raise ValueError(f"EngineConfig.kv_memory_bytes must be an int >= 1; got {self.kv_memory_bytes!r}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"EngineConfig.watermark must be in [0, 1); got {self.watermark!r}")


@dataclasses.dataclass
class EngineStats:
    """Counters of one engine (cumulative)."""
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0       # wall time of decode calls (dispatch + device work + readback)
    host_seconds: float = 0.0         # Python bookkeeping between decode calls (tokens, stops, preemption)
    compile_seconds: float = 0.0
    decode_calls: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    peak_pages_used: int = 0
    util_samples: list = dataclasses.field(default_factory=list)  # tokens stored / slots allocated

    @property
    def kv_utilization(self) -> float:
        return float(np.mean(self.util_samples)) if self.util_samples else float("nan")

    @property
    def host_overhead(self) -> float:
        total = self.decode_seconds + self.host_seconds
        return self.host_seconds / total if total else float("nan")


def _bucket(n: int, minimum: int) -> int:
    """Next power of two >= n (at least `minimum`): bounds the number of prefill compilations."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


class LLMEngine:
    """Continuous-batching generation with a paged KV cache.

    Args:
      model: a `models.GPT`.
      tokenizer: with encode/decode, eos_token_id and stop_token_ids.
      config: EngineConfig.
    """

    def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig()):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        mc = model.config
        self.max_model_len = min(config.max_model_len or mc.max_seq_len, mc.max_seq_len)
        self.pages_per_seq = -(-self.max_model_len // config.page_size)
        dtype = config.cache_dtype or np.dtype(model.dtype).name
        if config.num_pages is not None:
            self.cache_config = CacheConfig(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                            config.num_pages, config.page_size, dtype)
        else:
            self.cache_config = CacheConfig.from_memory(
                config.kv_memory_bytes, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
                head_dim=mc.head_dim, page_size=config.page_size, dtype=dtype)
        self.num_pages = self.cache_config.num_pages
        # A sequence must be able to reach its length limit alone in the pool, or preemption
        # could never make room for it.
        self.max_model_len = min(self.max_model_len, self.num_pages * config.page_size)
        stop_ids = set(getattr(tokenizer, "stop_token_ids", ()) or ()) | {tokenizer.eos_token_id}
        self.stop_ids = frozenset(i for i in stop_ids if i is not None)
        self.runner = ModelRunner(model, self.cache_config, max_seqs=config.max_seqs,
                                  pages_per_seq=self.pages_per_seq,
                                  steps_per_call=config.steps_per_call, stop_ids=self.stop_ids)
        self.stats = EngineStats()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}   # slot -> request
        self.admit_order: dict[int, int] = {}   # slot -> admission counter (newest = largest)
        self.finished: list[Request] = []
        self.free_pages = self.num_pages
        self._next_id = 0
        self._admissions = 0
        self._preempted_last_round = False

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt, params: SamplingParams | dict | None = None) -> Request:
        """Queues a prompt (text, or a list of token ids) with its SamplingParams (or a dict of them).

        Invalid requests (bad sampling values, empty or too long prompts) finish at once with
        finish_reason "error" and a message; they never stop other requests.
        """
        rid, self._next_id = self._next_id, self._next_id + 1
        text = prompt if isinstance(prompt, str) else ""
        req = Request(rid, text, [], SamplingParams())
        if isinstance(params, dict):
            try:
                params = SamplingParams(**params)
            except (TypeError, ValueError) as e:
                return self._fail(req, f"invalid sampling parameters: {e}")
        req.params = params or SamplingParams()
        try:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        except Exception as e:  # a tokenizer failure is this request's problem, not the batch's
            return self._fail(req, f"could not tokenize the prompt: {e}")
        req.prompt_ids = ids
        vocab = self.model.config.vocab_size
        if not ids:
            return self._fail(req, "empty prompt: nothing to condition on")
        if any(not 0 <= t < vocab for t in ids):
            return self._fail(req, f"prompt token ids must be in [0, {vocab})")
        limit = self.max_model_len
        if len(ids) >= limit:
            return self._fail(req, f"prompt has {len(ids)} tokens; this engine holds at most {limit} "
                                   f"tokens per sequence (max_model_len {self.max_model_len}, pool "
                                   f"{self.num_pages} pages x {self.config.page_size}), and one must be left "
                                   f"for the completion")
        self.waiting.append(req)
        return req

    def _fail(self, req: Request, message: str) -> Request:
        req.status, req.finish_reason, req.error = Status.FINISHED, "error", message
        self.finished.append(req)
        return req

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling

    def _prefill_tokens(self, req: Request) -> list[int]:
        # A preempted request recomputes everything but its pending (last sampled) token.
        return req.prompt_ids + req.output_ids[:-1]

    def _headroom(self) -> int:
        """Pages the running requests may take during the next decode call."""
        ps, k = self.config.page_size, self.config.steps_per_call
        stored = [req.num_tokens - 1 for req in self.running.values()]
        return sum(-(-min(n + k, self.max_model_len) // ps) - -(-n // ps) for n in stored)

    def _admit(self):
        if self._preempted_last_round:
            # Admitting now would only take back the pages just freed (vLLM does the same):
            # let the running requests advance first.
            self._preempted_last_round = False
            return
        free_slots = [s for s in range(self.config.max_seqs) if s not in self.running]
        watermark = int(self.config.watermark * self.num_pages)
        # Keep room for the running requests' next decode call, so admission does not cause
        # an immediate preemption.
        batch, free, width = [], self.free_pages - self._headroom(), 0
        while self.waiting and len(batch) < len(free_slots):
            req = self.waiting[0]
            toks = self._prefill_tokens(req)
            ps = self.config.page_size
            # Pages for the prompt plus its growth during the next decode call.
            need = -(-min(len(toks) + self.config.steps_per_call, self.max_model_len) // ps)
            idle = not self.running and not batch
            if free - need < watermark and not (idle and len(toks) <= self.num_pages * ps):
                break
            w = _bucket(max(width, len(toks)), 16)
            if batch and _bucket(len(batch) + 1, 1) * w > self.config.max_prefill_tokens:
                break
            self.waiting.popleft()
            batch.append((free_slots[len(batch)], req, toks))
            free, width = free - need, max(width, len(toks))
        if not batch:
            return
        rows, tok_rows, slots = [], [], []
        for slot, req, toks in batch:
            p = req.params
            resume = req.output_ids[-1] if req.output_ids else -1
            rows.append(RowParams(max_new=p.max_new_tokens, max_len=self.max_model_len,
                                  temperature=0.0 if p.is_greedy else float(p.temperature),
                                  top_k=p.top_k, top_p=float(p.top_p), seed=p.seed,
                                  ignore_eos=p.ignore_eos, num_generated=len(req.output_ids),
                                  resume_token=resume))
            tok_rows.append(toks)
            slots.append(slot)
        t0, c0 = time.perf_counter(), self.runner.compile_seconds
        tok, done, ok, free = self.runner.prefill(slots, tok_rows, rows, _bucket(len(batch), 1),
                                                  _bucket(width, 16))
        self.stats.prefill_seconds += time.perf_counter() - t0 - (self.runner.compile_seconds - c0)
        if not ok:  # cannot happen while the host's page count is right; never lose requests
            for _, req, _ in reversed(batch):
                self.waiting.appendleft(req)
            raise RuntimeError("internal error: prefill could not reserve pages the host counted as free")
        self.free_pages = free
        self.stats.peak_pages_used = max(self.stats.peak_pages_used, self.num_pages - free)
        self.stats.prefill_tokens += sum(len(t) for t in tok_rows)
        for (slot, req, _), t, d in zip(batch, tok, done):
            if req.output_ids:  # resumed after preemption: the pending token is already recorded
                assert int(t) == req.output_ids[-1]
            else:
                req.output_ids.append(int(t))
            req.status, req.slot = Status.RUNNING, slot
            self.running[slot] = req
            self._admissions += 1
            self.admit_order[slot] = self._admissions
            if d:
                self._finish(slot, self._device_reason(req), released=True)
            else:
                self._check_stop_strings(slot)

    def _preempt_newest(self):
        if len(self.running) == 1:  # cannot happen: one sequence always fits (max_model_len is capped)
            raise RuntimeError("internal error: a lone sequence ran out of pages")
        self._preempted_last_round = True
        slot = max(self.running, key=self.admit_order.__getitem__)
        req = self.running.pop(slot)
        self.runner.retire([slot])
        req.status, req.slot = Status.WAITING, -1
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)
        self.free_pages = int(self.runner.page_state.num_free)

    def _device_reason(self, req: Request) -> str:
        last = req.output_ids[-1]
        return "stop" if (last in self.stop_ids and not req.params.ignore_eos) else "length"

    def _finish(self, slot: int, reason: str, *, released: bool):
        req = self.running.pop(slot)
        del self.admit_order[slot]
        if not released:
            self.runner.retire([slot])
            self.free_pages = int(self.runner.page_state.num_free)
        req.status, req.finish_reason, req.slot = Status.FINISHED, reason, -1
        req.text = self._completion_text(req)
        self.finished.append(req)

    def _completion_text(self, req: Request) -> str:
        ids = req.output_ids
        if ids and ids[-1] in self.stop_ids and not req.params.ignore_eos:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for s in req.params.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        return text

    def _check_stop_strings(self, slot: int):
        req = self.running[slot]
        if req.params.stop:
            text = self.tokenizer.decode(req.output_ids)
            if any(s in text for s in req.params.stop):
                self._finish(slot, "stop", released=False)

    # ------------------------------------------------------------------ the loop

    def step(self):
        """One round: admission + prefill, then one decode call. Returns requests finished in it."""
        n_done = len(self.finished)
        self._admit()
        if not self.running:
            return self.finished[n_done:]
        t0, c0 = time.perf_counter(), self.runner.compile_seconds
        out, ok, free, active = self.runner.decode()
        t1 = time.perf_counter()
        # The first call compiles; compile time is reported on its own, not as decode time.
        # The call's own dispatch is counted as decode time: on a CPU backend JAX may run the
        # program inline in the call, so dispatch and device work cannot be told apart there.
        self.stats.decode_seconds += t1 - t0 - (self.runner.compile_seconds - c0)
        self.stats.decode_calls += 1
        self.stats.decode_steps += len(out)
        self.free_pages = free
        used = self.num_pages - free
        self.stats.peak_pages_used = max(self.stats.peak_pages_used, used)
        stored = 0
        for slot, req in list(self.running.items()):
            new = [int(t) for t in out[:, slot] if t >= 0]
            req.output_ids.extend(new)
            self.stats.decode_tokens += len(new)
            if not active[slot]:
                self._finish(slot, self._device_reason(req), released=True)
            else:
                stored += req.num_tokens - 1
                self._check_stop_strings(slot)
        if used:
            self.stats.util_samples.append(stored / (used * self.config.page_size))
        if not ok:
            self._preempt_newest()
        self.stats.host_seconds += time.perf_counter() - t1
        return self.finished[n_done:]

    def generate(self, prompts, params=None, *, progress: bool = False) -> list[RequestOutput]:
        """Runs prompts to completion with continuous batching; outputs in submission order.

        Args:
          prompts: list of str (or token-id lists).
          params: one SamplingParams (or dict) for all, or a list with one per prompt.
          progress: show a progress bar on stderr.
        """
        if params is None or isinstance(params, (SamplingParams, dict)):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params must be one SamplingParams or one per prompt ({len(prompts)}); "
                             f"got {len(params)}")
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(reqs), file=sys.stderr, unit="req", dynamic_ncols=True,
                       desc="generating")
            bar.update(sum(r.status is Status.FINISHED for r in reqs))
        while self.has_unfinished:
            done = self.step()
            if bar is not None:
                bar.update(sum(1 for r in done if r in reqs))
                s = self.stats
                bar.set_postfix(running=len(self.running), waiting=len(self.waiting),
                                tok_s=f"{s.decode_tokens / max(s.decode_seconds + s.host_seconds, 1e-9):.1f}",
                                refresh=False)
        if bar is not None:
            bar.close()
        self.stats.compile_seconds = self.runner.compile_seconds
        return [RequestOutput(r.request_id, r.prompt, r.text, tuple(r.prompt_ids), tuple(r.output_ids),
                              r.finish_reason, r.error, r.num_preemptions) for r in reqs]

    def pool_is_whole(self) -> bool:
        """True when no page is held (check after generate(): nothing leaked)."""
        return not self.running and self.runner.pool_is_whole()

    def summary(self) -> dict:
        """The run's figures, for the script's summary line and --json consumers."""
        s = self.stats
        wall = s.decode_seconds + s.host_seconds
        return {
            "prefill_tokens": s.prefill_tokens,
            "prefill_tok_s": s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else float("nan"),
            "decode_tokens": s.decode_tokens,
            "decode_tok_s": s.decode_tokens / wall if wall else float("nan"),
            "decode_seconds": wall,
            "host_overhead": s.host_overhead,
            "compile_seconds": self.runner.compile_seconds,
            "decode_compiles": self.runner.decode_traces,
            "prefill_compiles": self.runner.prefill_traces,
            "steps_per_call": self.config.steps_per_call,
            "decode_steps": s.decode_steps,
            "peak_pages_used": s.peak_pages_used,
            "num_pages": self.num_pages,
            "kv_utilization": s.kv_utilization,
            "preemptions": s.preemptions,
            "kv_cache": self.cache_config.describe(),
        }
