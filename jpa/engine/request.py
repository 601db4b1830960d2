"""A request's life on the host: prompt, sampling parameters, generated tokens, finish reason."""

import dataclasses
import enum

from jpa.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"      # in the queue (new, or preempted and waiting to be recomputed)
    RUNNING = "running"      # holds a slot and pages
    FINISHED = "finished"


@dataclasses.dataclass
class Request:
    """One generation request (host-side bookkeeping; the device sees only its slot)."""
    request_id: int
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None   # "stop" (EOS or stop string), "length", or "error"
    error: str | None = None
    slot: int = -1
    num_preemptions: int = 0
    text: str = ""                     # completion text (cut at a stop string)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence so far (prompt + generated)."""
        return len(self.prompt_ids) + len(self.output_ids)


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What generate() returns for each request, in submission order."""
    request_id: int
    prompt: str
    completion: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str
    error: str | None = None
    num_preemptions: int = 0

    def to_json(self) -> dict:
        return {"request_id": self.request_id, "prompt": self.prompt, "completion": self.completion,
                "token_ids": list(self.token_ids), "num_prompt_tokens": len(self.prompt_ids),
                "finish_reason": self.finish_reason, "error": self.error,
                "num_preemptions": self.num_preemptions}
