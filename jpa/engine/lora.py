"""LoRA adapters in the engine: the request's `LoRARequest`, and the host's record of which adapter sits
in which device slot (`LoraSlots`).

The device keeps `max_loras` adapter slots, stacked arrays the model declares
(`EngineModel.lora_slots(max_loras, max_lora_rank)`; models.lora: `[max_loras, layers, ...]`), passed to the
compiled step as an argument, never a constant: writing an adapter into a slot is a small program of its own
(`ModelRunner.install_lora`, compiled once when the engine starts), so loading, swapping and unloading
adapters never compile the step. Each row of the step carries its adapter's slot (`RaggedRows.lora` per
entry of the ragged pass, `SlotParams.lora` per decode slot; -1 for the base model).

Adapters beyond max_loras wait on the host: `add` reads an adapter into host memory
(`EngineModel.read_lora`, which raises ValueError for a bad directory, rank or target), and the
scheduler's admission `acquire`s a device slot for a request's adapter: the slot already holding it, else
a free slot, else the least recently used slot no running request uses (its adapter goes back to waiting on
the host). With every slot in use by running requests the request waits in the queue (admission stops
there, first come first served). A request gives its reference back when it leaves its decode slot
(`release`). The writes `acquire` decides are taken by the engine before the round's step (`take_installs`).
"""

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter a request runs with (vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`).

    Attributes:
      lora_name: the adapter's name (the server's `model` field names it).
      lora_int_id: a unique int >= 1 per adapter (the prefix cache and the slots key on it).
      lora_path: the PEFT adapter directory (adapter_config.json + adapter_model.safetensors).
    """
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string; got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1; got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) and hasattr(self.lora_path, "__fspath__"):
            object.__setattr__(self, "lora_path", str(self.lora_path))
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must be a non-empty path; got {self.lora_path!r}")


class LoraSlots:
    """The host's view of the device's adapter slots (see the module docstring).

    Args:
      read: read(path) -> the host arrays of one adapter (the model's `read_lora` at max_lora_rank); raises
        ValueError for a bad adapter.
      max_loras: device slots.
    """

    def __init__(self, read, max_loras: int):
        self._read = read
        self.max_loras = max_loras
        self.known: dict[int, tuple[LoRARequest, object]] = {}   # int id -> (request, host arrays)
        self.owner: list[int | None] = [None] * max_loras         # slot -> the int id it holds
        self.refs = [0] * max_loras                               # slot -> requests in decode slots using it
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()   # slots, least recent first
        self._installs: list[tuple[int, object]] = []             # (slot, host arrays) to write before the step
        self.loads = 0                                            # adapters written into a slot so far
        self.versions: dict[int, int] = {}                        # int id -> in-place updates (`update`)

    def add(self, req: LoRARequest) -> None:
        """Reads adapter `req` into host memory (once per int id: a later add of that id serves the weights loaded,
        whatever its path says; `update` replaces them). The same int id under another name, or the same name
        under another int id, is a ValueError."""
        if not isinstance(req, LoRARequest):
            raise ValueError(f"lora_request must be a jpa LoRARequest(lora_name, lora_int_id, lora_path); got "
                             f"{type(req).__name__}")
        have = self.known.get(req.lora_int_id)
        if have is not None:
            if have[0].lora_name != req.lora_name:
                raise ValueError(f"lora_int_id {req.lora_int_id} is adapter {have[0].lora_name!r}; got "
                                 f"{req.lora_name!r}")
            return
        clash = next((r for r, _ in self.known.values() if r.lora_name == req.lora_name), None)
        if clash is not None:
            raise ValueError(f"LoRA adapter name {req.lora_name!r} is taken by lora_int_id {clash.lora_int_id}")
        self.known[req.lora_int_id] = (req, self._read(req.lora_path))

    def update(self, req: LoRARequest) -> None:
        """Replaces loaded adapter req.lora_int_id's weights by those at req.lora_path (in place: its slot, if it
        has one, is rewritten before the next step; its version advances, so the prefix cache never serves KV of
        the old weights). The caller checks no request uses it. ValueError (nothing changed) for a bad adapter."""
        arrays = self._read(req.lora_path)
        self.known[req.lora_int_id] = (req, arrays)
        self.versions[req.lora_int_id] = self.versions.get(req.lora_int_id, 0) + 1
        slot = self.slot_of(req.lora_int_id)
        if slot >= 0:
            self._installs = [(s, a) for s, a in self._installs if s != slot] + [(slot, arrays)]

    def cache_key(self, int_id: int):
        """The prefix cache's key root of KV computed with adapter int_id's current weights."""
        return int_id, self.versions.get(int_id, 0)

    def by_name(self, name: str) -> LoRARequest | None:
        return next((r for r, _ in self.known.values() if r.lora_name == name), None)

    def remove(self, int_id: int) -> None:
        """Forgets adapter int_id (its slot, if any, is free again). The caller checks no request uses it."""
        self.known.pop(int_id)
        for s, o in enumerate(self.owner):
            if o == int_id:
                assert self.refs[s] == 0, f"adapter {int_id} is removed while slot {s} is in use"
                self.owner[s] = None
                self._lru.pop(s, None)
        self._installs = [(s, a) for s, a in self._installs if self.owner[s] is not None]

    def slot_of(self, int_id: int) -> int:
        """The slot holding adapter int_id, or -1."""
        return self.owner.index(int_id) if int_id in self.owner else -1

    def acquire(self, req: LoRARequest, count: int = 1) -> int | None:
        """A slot holding adapter `req` for `count` more requests (its reference count raised), or None when
        every slot is used by running requests. May evict an idle adapter and queue a write (`take_installs`)."""
        slot = self.slot_of(req.lora_int_id)
        if slot < 0:
            free = [s for s, o in enumerate(self.owner) if o is None]
            idle = [s for s in self._lru if self.refs[s] == 0]
            if not free and not idle:
                return None
            slot = free[0] if free else idle[0]
            self.owner[slot] = req.lora_int_id
            self._installs = [(s, a) for s, a in self._installs if s != slot]
            self._installs.append((slot, self.known[req.lora_int_id][1]))
            self.loads += 1
        self.refs[slot] += count
        self._lru.pop(slot, None)
        self._lru[slot] = None
        return slot

    def release(self, slot: int) -> None:
        """One request using `slot` left its decode slot."""
        assert self.refs[slot] > 0, f"adapter slot {slot} released more often than acquired"
        self.refs[slot] -= 1

    def take_installs(self) -> list[tuple[int, object]]:
        """The (slot, host arrays) writes decided since the last call, to run before the next step."""
        out, self._installs = self._installs, []
        return out
