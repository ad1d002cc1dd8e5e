"""The engine's adapters: which names exist, and which are loaded in memory.

Names: every adapter the engine has seen (from a request or :meth:`LoRARegistry.add`)
keeps its ``LoRARequest`` until :meth:`LoRARegistry.remove`; a request naming it with
another path or id is refused, so one name always means one set of weights (it is the key
that keeps cached KV apart). That holds after removal too: a removed name may come back
only with its old path and id, since KV blocks cached under it may still be in the pool.

Memory: loaded adapters are kept in a least-recently-used cache. An adapter that some
unfinished request uses is *pinned* (:meth:`acquire` / :meth:`release`) and never
evicted; the others stay loaded up to ``max_cpu_loras`` and beyond that the least recently
used is dropped (its name stays known, and it is read from its folder again when next
asked for). Which adapters sit in the model's active slots is the worker's business
(:class:`~prefixcache.lora.slots.LoRASlots`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from prefixcache.lora.adapter import LoRAAdapter, load_peft_adapter
from prefixcache.lora.errors import LoRAError, LoRANotFoundError
from prefixcache.lora.request import LoRARequest
from prefixcache.model.config import ModelArchConfig


class LoRARegistry:
    """Adapters by name for one base model (see the module docstring).

    Not thread-safe: the engine's thread owns it.
    """

    def __init__(self, arch_config: ModelArchConfig, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype) -> None:
        if max_lora_rank < 1 or max_cpu_loras < 1:
            raise ValueError(f"max_lora_rank and max_cpu_loras must be >= 1, got "
                             f"{max_lora_rank}, {max_cpu_loras}")
        self.arch_config = arch_config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.name_to_request: dict[str, LoRARequest] = {}
        # Removed adapters: their names stay bound to them (cached KV is keyed by name).
        self._removed_name_to_request: dict[str, LoRARequest] = {}
        # Loaded adapters, least recently used first.
        self._name_to_adapter: OrderedDict[str, LoRAAdapter] = OrderedDict()
        # Pinned adapters (by identity: a removed name may come back with new weights while
        # requests still use the old ones) -> how many unfinished requests use each.
        self._adapter_to_num_users: dict[LoRAAdapter, int] = {}
        self.num_loads = 0  # adapters read from disk, reloads after eviction included

    # -- names ------------------------------------------------------------------------

    def add(self, lora_request: LoRARequest) -> bool:
        """Load `lora_request`'s adapter and register its name; False (nothing changed) if
        that name is already registered for the same path and id. Raises LoRAError (or
        LoRANotFoundError) if it cannot be loaded or the name means another adapter."""
        known = self._check_name(lora_request)
        if known:
            return False
        self._load(lora_request)
        self.name_to_request[lora_request.lora_name] = lora_request
        return True

    def remove(self, lora_name: str) -> LoRARequest:
        """Forget `lora_name`. Requests already using it finish with it (they hold the
        weights); new ones may register the name again. Raises LoRANotFoundError for a
        name not registered."""
        lora_request = self.name_to_request.pop(lora_name, None)
        if lora_request is None:
            raise LoRANotFoundError(lora_name, "no adapter of that name is loaded")
        self._name_to_adapter.pop(lora_name, None)
        self._removed_name_to_request[lora_name] = lora_request
        return lora_request

    def list_requests(self) -> list[LoRARequest]:
        """The registered adapters, in registration order."""
        return list(self.name_to_request.values())

    @property
    def num_loaded(self) -> int:
        return len(self._name_to_adapter)

    def is_loaded(self, lora_name: str) -> bool:
        return lora_name in self._name_to_adapter

    # -- pinning for requests -------------------------------------------------------------

    def acquire(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter for a new request, registered and loaded if need be, and pinned
        until :meth:`release`. Raises as :meth:`add`."""
        self._check_name(lora_request)
        name = lora_request.lora_name
        adapter = self._name_to_adapter.get(name)
        if adapter is None:
            adapter = self._load(lora_request)
            self.name_to_request[name] = lora_request
        else:
            self._name_to_adapter.move_to_end(name)
        self._adapter_to_num_users[adapter] = self._adapter_to_num_users.get(adapter, 0) + 1
        return adapter

    def release(self, adapter: LoRAAdapter) -> None:
        """Unpin one use of `adapter` (a request using it finished)."""
        num_users = self._adapter_to_num_users.get(adapter, 0) - 1
        if num_users > 0:
            self._adapter_to_num_users[adapter] = num_users
            return
        self._adapter_to_num_users.pop(adapter, None)
        self._evict_to_capacity()

    # -- internals ----------------------------------------------------------------------

    def _check_name(self, lora_request: LoRARequest) -> bool:
        """True if the name is registered for exactly this path and id; False if it is new.
        Raises LoRAError if it is registered for another path or id, or the id is another
        adapter's."""
        if not isinstance(lora_request, LoRARequest):
            raise LoRAError(None, f"lora_request must be a LoRARequest, got "
                                  f"{type(lora_request).__name__}")
        name = lora_request.lora_name
        known = self.name_to_request.get(name)
        if known is not None:
            if known.lora_path != lora_request.lora_path:
                raise LoRAError(name, f"the name is already used for {known.lora_path}, "
                                      f"not {lora_request.lora_path}")
            if known.lora_int_id != lora_request.lora_int_id:
                raise LoRAError(name, f"the name is already used with lora_int_id "
                                      f"{known.lora_int_id}, not {lora_request.lora_int_id}")
            return True
        removed = self._removed_name_to_request.get(name)
        if removed is not None and (removed.lora_path, removed.lora_int_id) != \
                (lora_request.lora_path, lora_request.lora_int_id):
            raise LoRAError(name, f"the name was used for {removed.lora_path} (lora_int_id "
                                  f"{removed.lora_int_id}) until removed, and KV cached "
                                  "under it may remain: give another adapter another name")
        for other in self.name_to_request.values():
            if other.lora_int_id == lora_request.lora_int_id:
                raise LoRAError(name, f"lora_int_id {lora_request.lora_int_id} is already "
                                      f"used by adapter {other.lora_name!r}")
        return False

    def _load(self, lora_request: LoRARequest) -> LoRAAdapter:
        adapter = load_peft_adapter(lora_request, self.arch_config, self.max_lora_rank,
                                    self.dtype)
        self.num_loads += 1
        self._name_to_adapter[lora_request.lora_name] = adapter
        self._evict_to_capacity(keep=lora_request.lora_name)
        return adapter

    def _evict_to_capacity(self, keep: str | None = None) -> None:
        """Drop least recently used unpinned adapters while more than `max_cpu_loras` are
        loaded (pinned ones may hold it above that)."""
        excess = len(self._name_to_adapter) - self.max_cpu_loras
        if excess <= 0:
            return
        for name, adapter in list(self._name_to_adapter.items()):
            if excess == 0:
                break
            if name == keep or adapter in self._adapter_to_num_users:
                continue
            del self._name_to_adapter[name]
            excess -= 1
