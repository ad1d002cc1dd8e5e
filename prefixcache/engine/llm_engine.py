"""The synchronous engine: requests in, one scheduler step + model run + sampling per
:meth:`LLMEngine.step`, outputs out.

Data goes one way each step::

    Scheduler.schedule() -> ScheduledSequence[] -> ModelRunner.execute() -> logits
        -> Sampler.sample() -> Request.append_output_token_ids() -> stop checks
        -> Scheduler.finish_request() for requests that finished

The scheduler has already advanced every scheduled request's ``num_computed_tokens`` when
the model runs, so the only thing the engine feeds back is the sampled tokens and the
requests that finished.

Its parts are built from its options in ``engine_setup`` (the model, the KV pool's size,
the KV tier); a new request's checks that need no engine state are in ``request_checks``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prefixcache.config import CacheConfig, ModelConfig, SchedulerConfig
from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.core.request import Request, RequestStatus
from prefixcache.core.scheduler import Scheduler, SchedulerOutput
from prefixcache.engine.arg_utils import EngineArgs, config_from
from prefixcache.engine.engine_setup import (
    TORCH_DTYPES,
    default_num_kv_blocks,
    load_engine_model,
    open_kv_tier,
)
from prefixcache.engine.errors import InvalidRequestError
from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.request_checks import check_new_request
from prefixcache.engine.request_state import RequestState
from prefixcache.engine.sampler import Sampler
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.stats import EngineStats
from prefixcache.kv_tier.engine_link import offer_step_blocks
from prefixcache.lora.adapter import LoRAAdapter
from prefixcache.lora.errors import LoRAError
from prefixcache.lora.registry import LoRARegistry
from prefixcache.lora.request import LoRARequest
from prefixcache.model.loader import LoadedModel
from prefixcache.model.quantization import decode_weight_bytes, dense_weight_bytes
from prefixcache.worker.model_runner import ModelRunner
from prefixcache.worker.scheduled_sequence import ScheduledSequence


class LLMEngine:
    """One model, one paged KV cache, one scheduler. Not thread-safe: drive it from one
    thread (``AsyncLLM`` does so for the server).

    Use :meth:`from_options` or :meth:`from_engine_args` to build one. Attributes callers
    rely on: ``tokenizer``, ``max_model_len`` (the model's context length),
    ``num_kv_blocks``, ``block_size``, ``engine_args`` (the options it was built from).
    """

    def __init__(self, loaded_model: LoadedModel, model_config: ModelConfig,
                 engine_args: EngineArgs) -> None:
        """Use :meth:`from_engine_args`, which loads the model and resolves its config."""
        self.engine_args = engine_args
        self.model_config = model_config
        self.cache_config = cache_config = config_from(engine_args, CacheConfig)
        self.scheduler_config = scheduler_config = config_from(
            engine_args, SchedulerConfig,
            max_loras=engine_args.max_loras if engine_args.enable_lora else None)
        self.loaded_model = loaded_model
        self.tokenizer = loaded_model.tokenizer
        self.arch_config = loaded_model.arch_config
        self.max_model_len = self.arch_config.max_position_embeddings
        self.quantization = model_config.quantization
        # Memory outside the KV pool: the dense weights plus any quantized decode copies.
        self.dense_weight_bytes = dense_weight_bytes(loaded_model.model)
        self.decode_weight_bytes = decode_weight_bytes(loaded_model.model)
        self.block_size = cache_config.block_size
        dtype = TORCH_DTYPES[model_config.dtype]
        self.num_kv_blocks = (
            cache_config.num_kv_blocks
            if cache_config.num_kv_blocks is not None
            else default_num_kv_blocks(loaded_model, cache_config, scheduler_config, dtype)
        )
        self.kv_cache_manager = KVCacheManager(
            self.num_kv_blocks,
            self.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.hash_algo,
            hash_seed=engine_args.hash_seed,
            enable_events=cache_config.enable_kv_events,
            eviction_policy=cache_config.eviction_policy,
        )
        self.kv_tier = open_kv_tier(engine_args, loaded_model, self.kv_cache_manager, dtype) \
            if engine_args.kv_tier is not None else None
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager, self.kv_tier)
        self.runner = ModelRunner(
            loaded_model.model, self.arch_config, self.num_kv_blocks, self.block_size, dtype,
            max_loras=engine_args.max_loras if engine_args.enable_lora else None,
            compile_decode=engine_args.optimization_level > 0,
            paged_attention_kernel=engine_args.optimization_level > 0,
        )
        self.runner.compile_decode_steps(scheduler_config.max_num_seqs)
        self.lora_registry: LoRARegistry | None = None
        if engine_args.enable_lora:
            self.lora_registry = LoRARegistry(
                self.arch_config, engine_args.max_lora_rank,
                engine_args.max_cpu_loras or engine_args.max_loras, dtype,
            )
        # The adapter of each unfinished request that uses one (pinned in the registry).
        self._request_id_to_adapter: dict[str, LoRAAdapter] = {}
        self.sampler = Sampler(engine_args.seed)
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        self.eos_token_ids: tuple[int, ...] = tuple(eos) or tuple(self.arch_config.eos_token_ids)
        self.vocab_size = self.arch_config.vocab_size
        self.request_states: dict[str, RequestState] = {}
        # Outputs decided outside a step (aborts) are delivered by the next step().
        self._pending_outputs: list[RequestOutput] = []
        # The counters, kept up to date where they happen; get_stats adds the gauges.
        self._stats = EngineStats(num_kv_blocks=self.num_kv_blocks, cache_config_info=(
            # vLLM's label names, where vLLM has the setting.
            ("block_size", str(self.block_size)),
            ("num_gpu_blocks", str(self.num_kv_blocks)),
            ("enable_prefix_caching", str(cache_config.enable_prefix_caching)),
            ("prefix_caching_hash_algo", cache_config.hash_algo),
            ("eviction_policy", cache_config.eviction_policy)))

    @classmethod
    def from_options(cls, model: str | Path | LoadedModel | None = None,
                     **options: Any) -> LLMEngine:
        """``from_engine_args(EngineArgs(model, **options))``: the options are the fields
        of :class:`~prefixcache.engine.arg_utils.EngineArgs`, which documents them and
        their defaults."""
        return cls.from_engine_args(EngineArgs(model, **options))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """Load the model and build the engine the (already checked) arguments describe.

        A loaded model whose weights are in another dtype, or that was loaded with another
        quantization, than the one asked for is refused. Raises ValueError for that,
        FileNotFoundError for a missing model and ValueError naming the model for one
        that cannot be loaded (not a model, corrupt, an unsupported architecture).
        """
        loaded, model_config = load_engine_model(engine_args)
        return cls(loaded, model_config, engine_args)

    # -- requests in and out ------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        prompt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; it runs from the next :meth:`step`, with the LoRA adapter of
        ``lora_request`` if given (loaded now if need be; see :meth:`add_lora`).

        The engine runs one sample per request (``sampling_params.n`` is the caller's to
        expand). Raises :class:`~prefixcache.engine.errors.InvalidRequestError` (a
        ValueError naming the request and the field at fault), and queues nothing, for: an
        id in use (``param="request_id"``), invalid params (None: the message names the
        parameter), an empty prompt or a token id outside the vocabulary, a prompt plus
        ``max_tokens`` beyond ``max_model_len``, or a prompt that can never fit the KV pool
        (``"prompt"``), an adapter that cannot be used or LoRA not enabled
        (``"lora_request"``; caused by a :class:`~prefixcache.lora.errors.LoRAError`). A
        ``request_id`` that is not a string is a plain ValueError.

        An id is in use from ``add_request`` until :meth:`step` has returned its final
        output; for an aborted request that is the step after :meth:`abort_request`. So
        one step's outputs never hold two requests under one id.

        A prompt that fits the pool is accepted even when prompt plus ``max_tokens`` does
        not: it may well stop at EOS first, and a small pool is the operator's choice,
        not the client's error. If its tokens do outgrow the pool, it ends with
        ``"length"``, keeping every token generated so far, as at ``max_model_len``.
        """
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        if request_id in self.request_states:
            raise InvalidRequestError(request_id, "the request id is already in use",
                                      "request_id")
        # Aborts are few and delivered by the next step, so this scan stays short.
        if any(output.request_id == request_id for output in self._pending_outputs):
            raise InvalidRequestError(request_id, "the request id is still in use: it was "
                                      "aborted and step() has not yet returned its final "
                                      "output", "request_id")
        prompt_token_ids = check_new_request(request_id, prompt_token_ids, sampling_params,
                                             lora_request, vocab_size=self.vocab_size,
                                             max_model_len=self.max_model_len)
        request = Request(
            request_id, prompt_token_ids, cache_salt=cache_salt,
            lora_name=None if lora_request is None else lora_request.lora_name,
            lora_path=None if lora_request is None else lora_request.lora_path,
            lora_id=None if lora_request is None else lora_request.lora_int_id,
        )
        adapter = None
        if lora_request is not None:
            try:
                # Pinned from here on: released when the request finishes, or just below.
                adapter = self._lora_registry_or_raise().acquire(lora_request)
            except LoRAError as error:
                raise InvalidRequestError(request_id, str(error), "lora_request") from error
        try:
            # Refused if the prompt alone can never fit the pool; max_tokens is not
            # counted (see above). The id cannot clash: it was checked above.
            self.scheduler.add_request(request)
        except ValueError as error:
            if adapter is not None:
                self.lora_registry.release(adapter)
            raise InvalidRequestError(request_id, str(error), "prompt") from error
        if adapter is not None:
            self._request_id_to_adapter[request_id] = adapter
        self.request_states[request_id] = RequestState(
            request,
            sampling_params,
            self.tokenizer,
            self.eos_token_ids,
            time.time() if arrival_time is None else arrival_time,
            prompt=prompt,
        )

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Finish requests with ``"abort"`` and free their blocks; unknown or already
        finished ids are ignored. Their final outputs (cumulative text and tokens, nothing
        held back) come with the next :meth:`step`, ahead of its other outputs; until then
        :meth:`add_request` refuses their ids."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in list(request_ids):
            state = self.request_states.pop(request_id, None)
            if state is None:
                continue
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
            self._release_adapter(request_id)
            state.finish(RequestStatus.FINISHED_ABORTED)
            self._pending_outputs.append(state.make_output())

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or an abort's final output is undelivered."""
        return bool(self.request_states) or bool(self._pending_outputs)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.request_states)

    # -- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, check stops. Returns one output per request
        that got a token or finished in this step (plus pending abort outputs)."""
        outputs = self._pending_outputs
        self._pending_outputs = []
        self._stats.num_steps += 1
        scheduler_output = self.scheduler.schedule()
        for request in scheduler_output.finished_requests:
            # The scheduler ended it (it outgrew the whole KV pool) and set the status.
            outputs.append(self._finish(request.request_id, request.status))
        if scheduler_output.scheduled:
            self._run(scheduler_output, outputs)
        return outputs

    def _run(self, scheduler_output: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        states = self.request_states
        sequences = []
        sampling_states = []
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            state = states[request.request_id]
            if state.num_cached_tokens is None:  # first admission
                state.num_cached_tokens = scheduled.num_hit_tokens + \
                    scheduled.num_external_tokens
                self._stats.prompt_tokens += request.num_prompt_tokens
                if self.kv_tier is not None and not request.skip_reading_prefix_cache:
                    self._stats.external_prefix_cache_queries += request.num_tokens
                    self._stats.external_prefix_cache_hits += scheduled.num_external_tokens
            sequences.append(ScheduledSequence(
                request.request_id, scheduled.token_ids, scheduled.start_position,
                scheduled.block_ids, scheduled.needs_logits,
                self._request_id_to_adapter.get(request.request_id),
            ))
            if scheduled.needs_logits:
                sampling_states.append(state)
        try:
            self._write_external_blocks(scheduler_output)
            logits = self.runner.execute(sequences)
        except Exception as error:  # noqa: BLE001 - reported on every request of the step
            message = f"model execution failed: {type(error).__name__}: {error}"
            for scheduled in scheduler_output.scheduled:
                # Blocks scheduled full this step were cached already: no KV behind them
                # (nor, to be safe, behind blocks that were to be loaded from the tier).
                self.kv_cache_manager.uncache_uncomputed(
                    scheduled.request,
                    scheduled.start_position - scheduled.num_external_tokens)
                outputs.append(self._finish(scheduled.request.request_id,
                                            RequestStatus.FINISHED_ERROR, message))
            return
        if self.kv_tier is not None:
            offer_step_blocks(self.kv_tier, scheduler_output.scheduled, self.block_size,
                              self.runner.read_kv_blocks)
        token_ids = self.sampler.sample(
            logits, [s.params for s in sampling_states], [s.generator for s in sampling_states]
        )
        self._stats.generation_tokens += len(token_ids)
        max_model_len = self.max_model_len
        for state, token_id in zip(sampling_states, token_ids, strict=True):
            state.request.append_output_token_ids(token_id)
            status = state.append_token(token_id, max_model_len)
            if status is None:
                outputs.append(state.make_output())
            else:
                outputs.append(self._finish(state.request.request_id, status))

    def _write_external_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """Copy the blocks the scheduler loaded from the KV tier into the KV cache."""
        external_blocks = [block for scheduled in scheduler_output.scheduled
                           for block in scheduled.external_blocks]
        if external_blocks:
            self.runner.write_kv_blocks([block.block_id for block in external_blocks],
                                        [block.payload for block in external_blocks])

    def _finish(self, request_id: str, status: RequestStatus,
                error: str | None = None) -> RequestOutput:
        state = self.request_states.pop(request_id)
        self.scheduler.finish_request(request_id, status)  # no-op if the scheduler did it
        self._release_adapter(request_id)
        state.finish(status, error)
        return state.make_output()

    # -- LoRA adapters ------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and register an adapter ahead of its requests (vLLM's ``add_lora``); False
        if that name is already registered for the same path and id. Raises
        :class:`~prefixcache.lora.errors.LoRAError` (LoRANotFoundError for a missing
        folder) if LoRA is not enabled or the adapter cannot be used."""
        return self._lora_registry_or_raise().add(lora_request)

    def remove_lora(self, lora_name: str) -> LoRARequest:
        """Forget adapter ``lora_name``; requests already using it finish with it. Its
        cached KV blocks stay until evicted, keyed by the name, so the name can come back
        only for the same adapter (path and id). Raises LoRANotFoundError for an unknown
        name."""
        return self._lora_registry_or_raise().remove(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters (empty without LoRA)."""
        return [] if self.lora_registry is None else self.lora_registry.list_requests()

    def _lora_registry_or_raise(self) -> LoRARegistry:
        if self.lora_registry is None:
            raise LoRAError(None, "LoRA is not enabled: build the engine with "
                                  "enable_lora=True (serve --enable-lora)")
        return self.lora_registry

    def _release_adapter(self, request_id: str) -> None:
        adapter = self._request_id_to_adapter.pop(request_id, None)
        if adapter is not None:
            self.lora_registry.release(adapter)

    # -- cache and stats --------------------------------------------------------------------

    def reset_prefix_cache(self, reset_kv_tier: bool = False) -> bool:
        """Forget every cached block; False (and nothing changed) while requests hold
        blocks. With ``reset_kv_tier``, a successful reset also deletes this engine's
        blocks (its layout's) from the KV tier, which other replicas share."""
        if not self.kv_cache_manager.reset_prefix_cache():
            return False
        if reset_kv_tier and self.kv_tier is not None:
            self.kv_tier.clear()
        return True

    def close(self) -> None:
        """Write the KV tier's queued blocks (a few seconds at most) and release it. The
        engine needs no other cleanup; calling it twice is harmless."""
        if self.kv_tier is not None:
            self.kv_tier.close()

    def get_stats(self) -> EngineStats:
        """Cumulative counters and current gauges (see :class:`EngineStats`; the KV
        event counters are the publisher's, which ``AsyncLLM`` adds)."""
        stats = self._stats
        # Counts since the last read: the manager resets them.
        stats.add_prefix_cache_stats(self.kv_cache_manager.make_prefix_cache_stats())
        stats.num_preemptions = self.scheduler.num_preemptions
        stats.num_evictions = self.kv_cache_manager.block_pool.num_evictions
        stats.num_running = self.scheduler.num_running
        stats.num_waiting = self.scheduler.num_waiting
        stats.kv_cache_usage = self.kv_cache_manager.usage
        free_block_queue = self.kv_cache_manager.block_pool.free_block_queue
        stats.eviction_candidates = tuple(free_block_queue.candidate_standings())
        stats.eviction_policy_switches = free_block_queue.num_switches
        if self.kv_tier is not None:
            stats.add_kv_tier_stats(self.kv_tier.stats)
        return copy.copy(stats)

    def take_kv_events(self) -> list:
        """Core KV cache events since the last call (empty unless ``enable_kv_events``)."""
        if not self.cache_config.enable_kv_events:
            return []
        return self.kv_cache_manager.take_events()

