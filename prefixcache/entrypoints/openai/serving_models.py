"""The models a server answers to: the base model under its served names, and the LoRA
adapters loaded into its engine (vLLM's ``OpenAIServingModels``).

A request's ``model`` names either; :meth:`ServedModels.resolve` says which, and which
adapter. ``/v1/models`` lists both, each adapter with ``parent`` set to the base model's
first name. ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change the adapters
at run time: a name comes back only for the folder it was first loaded from (its id kept),
since the engine keys cached KV blocks by the adapter's name.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixcache.engine.async_llm import AsyncLLM
from prefixcache.engine.errors import EngineDeadError
from prefixcache.entrypoints.openai.errors import APIError, bad_request
from prefixcache.entrypoints.openai.protocol import ModelCard
from prefixcache.lora.errors import LoRAError, LoRANotFoundError
from prefixcache.lora.request import LoRARequest


class ServedModels:
    """The base model's names and the adapters loaded into ``llm``'s engine.

    ``lora_modules``: adapters already loaded (``serve --lora-modules``); ``enable_lora``:
    the engine serves adapters at all (otherwise loading one is a 400).
    """

    def __init__(self, llm: AsyncLLM, served_model_names: tuple[str, ...], root: str,
                 max_model_len: int, lora_modules: Sequence[LoRARequest] = (),
                 enable_lora: bool = False) -> None:
        self.llm = llm
        self.served_model_names = served_model_names
        self.root = root
        self.max_model_len = max_model_len
        self.enable_lora = enable_lora
        self.lora_name_to_request = {m.lora_name: m for m in lora_modules}
        self._next_lora_int_id = max((m.lora_int_id for m in lora_modules), default=0) + 1
        self._unloaded_lora_name_to_request: dict[str, LoRARequest] = {}

    def resolve(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """The model name to report for a request's ``model`` and the adapter it names
        (None: the base model). 404 ``model_not_found`` for a name served by neither."""
        names = self.served_model_names
        if requested is None:
            return names[0], None
        if requested in names:
            return requested, None
        lora_request = self.lora_name_to_request.get(requested)
        if lora_request is None:
            served = ", ".join([*names, *self.lora_name_to_request])
            raise APIError(404, f"the model '{requested}' does not exist; this server "
                           f"serves {served}", param="model", code="model_not_found")
        return requested, lora_request

    def model_cards(self, created: int) -> list[ModelCard]:
        """The base model under each served name, then every adapter with its parent."""
        cards = [ModelCard(id=name, created=created, root=self.root,
                           max_model_len=self.max_model_len)
                 for name in self.served_model_names]
        cards += [ModelCard(id=name, created=created, root=lora.lora_path,
                            parent=self.served_model_names[0],
                            max_model_len=self.max_model_len)
                  for name, lora in self.lora_name_to_request.items()]
        return cards

    async def load_lora_adapter(self, lora_name: str, lora_path: str,
                                load_inplace: bool = False) -> str:
        """Load an adapter and serve it under ``lora_name``; vLLM's success message. 400
        if LoRA is off, the name is taken or the adapter unusable; 404 for a missing
        folder."""
        self._check_lora_enabled()
        if lora_name in self.served_model_names:
            raise bad_request(f"'{lora_name}' is the base model's name", param="lora_name")
        if lora_name in self.lora_name_to_request:
            message = f"the LoRA adapter '{lora_name}' has already been loaded"
            if load_inplace:
                message += ("; replacing it in place is not supported, since KV blocks "
                            "cached under its name would be reused: load it under a new name")
            raise bad_request(message, param="lora_name")
        unloaded = self._unloaded_lora_name_to_request.get(lora_name)
        if unloaded is not None and unloaded.lora_path == lora_path:
            lora_request = unloaded
        else:
            lora_request = LoRARequest(lora_name, self._next_lora_int_id, lora_path)
        try:
            await self.llm.add_lora(lora_request)
        except LoRAError as exc:
            raise lora_api_error(exc) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from exc
        if lora_request is not unloaded:
            self._next_lora_int_id += 1
        self.lora_name_to_request[lora_name] = lora_request
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload_lora_adapter(self, lora_name: str) -> str:
        """Stop serving adapter ``lora_name`` (requests using it finish with it); vLLM's
        success message. 404 for a name not loaded."""
        self._check_lora_enabled()
        if lora_name not in self.lora_name_to_request:
            raise APIError(404, f"the LoRA adapter '{lora_name}' cannot be found",
                           param="lora_name", code="lora_adapter_not_found")
        # Unlisted first: no new request can ask for it while the engine forgets it.
        self._unloaded_lora_name_to_request[lora_name] = \
            self.lora_name_to_request.pop(lora_name)
        try:
            await self.llm.remove_lora(lora_name)
        except LoRANotFoundError:
            pass  # the engine never kept it; it is unloaded all the same
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from exc
        return f"Success: LoRA adapter '{lora_name}' removed successfully."

    def _check_lora_enabled(self) -> None:
        if not self.enable_lora:
            raise bad_request("LoRA adapters are not enabled on this server "
                              "(serve --enable-lora)", code="lora_not_enabled")


def lora_api_error(error: LoRAError, param: str = "lora_path") -> APIError:
    """404 for an adapter (or its folder) that does not exist, else 400."""
    if isinstance(error, LoRANotFoundError):
        return APIError(404, str(error), param=param, code="lora_adapter_not_found")
    return bad_request(str(error), param=param, code="invalid_lora_adapter")
