"""A request's life on the host: prompt, sampling parameters, generated tokens, finish reason."""

import dataclasses
import enum
import math
from typing import NamedTuple

from jpa.engine.detokenizer import IncrementalDetokenizer
from jpa.engine.sampling import SamplingParams


class Phase(enum.Enum):
    """Where a request is in its life. Only `Scheduler._move` changes it, along `NEXT_PHASES`."""
    WAITING = "waiting"        # queued: new, or preempted and waiting to be recomputed (or a parallel
                               # sample waiting with its leader)
    PREFILLING = "prefilling"  # holds a slot; its prompt (or recompute) is not all in the cache yet
    FORKING = "forking"        # a parallel sample holding an empty slot until its leader's last chunk
    DECODING = "decoding"      # holds a slot and decodes
    FINISHED = "finished"


# The transitions a request may make (anything else is a scheduler bug and raises).
NEXT_PHASES = {
    Phase.WAITING: {Phase.PREFILLING, Phase.FORKING, Phase.FINISHED},
    Phase.PREFILLING: {Phase.DECODING, Phase.WAITING, Phase.FINISHED},
    Phase.FORKING: {Phase.DECODING, Phase.WAITING, Phase.FINISHED},
    Phase.DECODING: {Phase.WAITING, Phase.FINISHED},
    Phase.FINISHED: set(),
}


class PromptLogprob(NamedTuple):
    """One prompt token's entry of `RequestOutput.prompt_logprobs` (vLLM's Logprob, per position).

    Attributes:
      logprob: log-probability of the token given the prompt before it (the model's raw
        distribution).
      rank: its rank there (1 = the most likely; vLLM's count of tokens at least as likely).
      top: ((token id, log-probability), ...) of the k most likely tokens there, best first
        (k = SamplingParams.prompt_logprobs).
    """
    logprob: float
    rank: int
    top: tuple = ()


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request (host-side bookkeeping; the device sees only its slot)."""
    request_id: object
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None = None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)  # one per output id
    output_top_logprobs: list[tuple] = dataclasses.field(default_factory=list)  # one per output id when
                                                                                 # params.top_logprobs > 0
    phase: Phase = Phase.WAITING
    finish_reason: str | None = None   # "stop" (EOS or stop string), "length", "abort" or "error"
    error: str | None = None
    slot: int = -1
    num_preemptions: int = 0
    admitted_at: int = -1              # admission counter of its current stay in a slot
    # Device mirror, set at admission and from the device's seq_lens after every call: tokens of
    # this request in its slot's cache (its prompt, then its prompt and all but the pending token).
    num_computed_tokens: int = 0
    cache_refs: tuple[int, ...] = ()   # prefix-cache pages it holds (its hits, then its cached prompt pages)
    num_cached_tokens: int = 0         # prompt tokens found in the prefix cache at its first admission
    cow_pending: bool = False          # may still share a partly filled last page after a fork (its next
                                       # token may take a copy-on-write page)
    # Parallel sampling (SamplingParams.n > 1): the first sample leads; the others wait in
    # `siblings` until its prompt is computed, then fork its pages (their `leader` is set).
    siblings: list = dataclasses.field(default_factory=list)
    leader: "Request | None" = None
    num_samples: int = 1               # on the first sample: how many the request asked for (n)
    # params.prompt_logprobs set: position -> PromptLogprob of the prompt tokens 1.. computed so far
    # (filled chunk by chunk; a recompute after preemption fills nothing twice). The samples of a
    # parallel-sampling request share their leader's dict: computed once, reported with each.
    prompt_lp: dict | None = None
    prompt_lp_sent: bool = False       # handed out in a StepOutput already
    num_draft_tokens: int = 0          # speculative decoding: drafts verified for it
    num_accepted_tokens: int = 0       # of them, accepted
    # params.structured set: its grammar state (`jpa.engine.structured.Matcher`), fed every output
    # token; each parallel sample has its own.
    matcher: object = None
    # Weight updates (`LLMEngine.update_weights`): the weight version of each run of output tokens,
    # [(index of its first token, version), ...], and the version when it was added; kv_epoch, the
    # prefix cache's epoch its cached KV belongs to (None: the current one; set to the old one for
    # requests holding a slot across an update, so pages computed from old weights are never reused).
    weight_runs: list = dataclasses.field(default_factory=list)
    weight_version: int = 0
    kv_epoch: int | None = None
    # LoRA (`jpa.engine.lora`): the adapter it runs with (None: the base model), and the device slot holding
    # it while the request holds a decode slot (-1 otherwise).
    lora_request: object = None
    lora_slot: int = -1
    lora_cache_key: object = None      # the adapter's prefix-cache key root (its id and weights' version)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs and some are not computed yet."""
        return self.prompt_lp is not None and len(self.prompt_lp) < len(self.prompt_ids) - 1

    @property
    def prompt_logprobs(self) -> tuple | None:
        """(None, PromptLogprob, ...) per prompt token once all are computed, else None."""
        lp = self.prompt_lp
        if lp is None or len(lp) < len(self.prompt_ids) - 1:
            return None
        return (None, *(lp[p] for p in range(1, len(self.prompt_ids))))

    def take_prompt_logprobs(self) -> tuple | None:
        """prompt_logprobs the first time they are complete (a stream carries them once), else None."""
        if self.prompt_lp_sent:
            return None
        out = self.prompt_logprobs
        self.prompt_lp_sent = out is not None
        return out

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence so far (prompt + generated)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def text(self) -> str:
        """Completion text so far (cut before a stop string)."""
        return self.detokenizer.text if self.detokenizer is not None else ""

    def note_tokens(self, count: int, version: int) -> None:
        """`count` tokens were just appended to output_ids, sampled with weight version `version`."""
        if count and (not self.weight_runs or self.weight_runs[-1][1] != version):
            self.weight_runs.append((len(self.output_ids) - count, version))
        self.weight_version = version if count else self.weight_version

    @property
    def weight_versions(self) -> tuple[int, ...] | None:
        """The weight version of each output token when they differ (an update in flight), else None."""
        if len(self.weight_runs) < 2:
            return None
        bounds = [start for start, _ in self.weight_runs[1:]] + [len(self.output_ids)]
        out = [self.weight_runs[0][1]] * bounds[0]
        for (start, v), end in zip(self.weight_runs, bounds):
            out[start:end] = [v] * (end - start)
        return tuple(out[: len(self.output_ids)])

    def to_output(self) -> "RequestOutput":
        return RequestOutput(self.request_id, self.prompt, self.text, tuple(self.prompt_ids),
                             tuple(self.output_ids), self.finish_reason, self.error, self.num_preemptions,
                             tuple(self.output_logprobs), tuple(self.output_top_logprobs), self.prompt_logprobs,
                             self.num_draft_tokens, self.num_accepted_tokens, self.num_cached_tokens,
                             weight_version=self.weight_version, weight_versions=self.weight_versions)


class Logprob(NamedTuple):
    """One token's entry in `CompletionOutput.logprobs` (vLLM's Logprob)."""
    logprob: float
    rank: int | None = None          # 1 = the most likely; None where not known (outside the top k)
    decoded_token: str | None = None


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One sample of a request, as vLLM's `CompletionOutput` (`RequestOutput.outputs[index]`).

    Attributes:
      index: the sample's index (0 .. n - 1).
      text, token_ids, finish_reason: the sample's completion.
      cumulative_logprob: the sum of its tokens' logprobs.
      logprobs: per token, {token id: Logprob} with the sampled token first and the top tokens after it
        (SamplingParams.top_logprobs / logprobs), vLLM's shape.
    """
    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A finished request: what generate() returns, in submission order.

    jpa's flat fields (`completion`, `token_ids`, `logprobs`, ...) are those of the request's (first)
    sample; vLLM's `outputs[j]` (a CompletionOutput per sample, n of them for SamplingParams.n = n),
    `prompt_token_ids` and `finished` read the same result the way vLLM users do."""
    request_id: object
    prompt: str
    completion: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str
    error: str | None = None
    num_preemptions: int = 0
    logprobs: tuple[float, ...] = ()   # of each token id, under the distribution it was sampled from
    # With SamplingParams.top_logprobs = k: per token id, ((token id, log-probability), ...) of the k
    # most likely tokens of that same distribution; () otherwise.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # before it), a PromptLogprob for each other; None when not asked for (or not computed).
    prompt_logprobs: tuple | None = None
    # Speculative decoding: draft tokens verified for this request and how many were accepted (0
    # without it). Its tokens are those it would have without speculation either way.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Prompt tokens found in the prefix cache when it was first admitted (OpenAI's
    # usage.prompt_tokens_details.cached_tokens); 0 without a prefix cache.
    num_cached_tokens: int = 0
    # The weight version (`LLMEngine.update_weights`: 0 until the first update) its last token was
    # sampled with (the version when it was added, if it has none); weight_versions: each token's,
    # when an update happened while it ran (pause_generation(mode="keep")), else None.
    weight_version: int = 0
    weight_versions: tuple[int, ...] | None = None
    # n > 1: every sample's RequestOutput (this one is samples[0]), set by `with_samples`.
    samples: tuple = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's view: one CompletionOutput per sample."""
        return [s.completion_output(j) for j, s in enumerate(self.samples or (self,))]

    @property
    def prompt_token_ids(self) -> list[int]:
        """vLLM's name of prompt_ids."""
        return list(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return True

    def completion_output(self, index: int = 0) -> CompletionOutput:
        """This result as sample `index` of vLLM's `outputs`."""
        lps = [float(x) for x in self.logprobs]
        per_token = None
        if lps:
            per_token = []
            for i, (tok, lp) in enumerate(zip(self.token_ids, lps)):
                top = self.top_logprobs[i] if i < len(self.top_logprobs) else ()
                rank = next((r for r, (t, _) in enumerate(top, 1) if t == tok), None)
                entry = {int(tok): Logprob(lp, rank)}
                for r, (t, l) in enumerate(top, 1):
                    entry.setdefault(int(t), Logprob(float(l), r))
                per_token.append(entry)
        return CompletionOutput(index, self.completion, tuple(self.token_ids),
                                float(sum(lps)) if lps else None, per_token, self.finish_reason)

    @staticmethod
    def with_samples(samples) -> "RequestOutput":
        """One RequestOutput for the n samples of a request (vLLM's shape): the first sample's fields,
        `outputs[j]` for sample j."""
        samples = tuple(samples)
        return dataclasses.replace(samples[0], samples=samples)

    def to_json(self) -> dict:
        out = {"request_id": self.request_id, "prompt": self.prompt, "completion": self.completion,
               "token_ids": list(self.token_ids), "num_prompt_tokens": len(self.prompt_ids),
               "finish_reason": self.finish_reason, "error": self.error,
               "num_preemptions": self.num_preemptions,
               # each token's log-probability (None where it is not a number)
               "logprobs": [lp if math.isfinite(lp) else None for lp in map(float, self.logprobs)]}
        out["weight_version"] = self.weight_version
        if self.weight_versions is not None:
            out["weight_versions"] = list(self.weight_versions)
        if self.num_draft_tokens:
            out["num_draft_tokens"] = self.num_draft_tokens
            out["num_accepted_tokens"] = self.num_accepted_tokens
        if self.prompt_logprobs is not None:
            out["prompt_token_ids"] = list(self.prompt_ids)
            out["prompt_logprobs"] = [None if e is None else
                                      {"logprob": e.logprob, "rank": e.rank, "top": [list(t) for t in e.top]}
                                      for e in self.prompt_logprobs]
        return out


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one engine round did for one request (a streaming server forwards these).

    Attributes:
      request_id: the request.
      new_token_ids: tokens appended to its output this round (a stopped request's tokens end at
        the stop; a final EOS token is included, as in RequestOutput.token_ids).
      new_text: completion text produced this round. Text that may be the start of a stop string
        is held back until it is known not to be one; the pieces of all rounds concatenate to
        the final completion.
      finished: the request is done; `output` holds its result and it will not appear again.
      output: the RequestOutput when finished, else None.
      new_logprobs: log-probability of each of new_token_ids (see `sampling.sample_with_logprobs`).
      new_top_logprobs: with SamplingParams.top_logprobs, the top tokens of each new token (as in
        RequestOutput.top_logprobs).
      prompt_logprobs: with SamplingParams.prompt_logprobs, the request's prompt_logprobs (as in
        RequestOutput) in the first output after they are all computed (with its first token),
        else None.
    """
    request_id: object
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    output: RequestOutput | None = None
    new_logprobs: tuple[float, ...] = ()
    new_top_logprobs: tuple = ()
    prompt_logprobs: tuple | None = None
