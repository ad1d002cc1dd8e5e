"""prefixcache.engine — the synchronous engine (:class:`LLMEngine`), sampling and outputs."""

from prefixcache.engine.outputs import RequestMetrics, RequestOutput
from prefixcache.engine.sampling_params import SamplingParams

__all__ = ["RequestMetrics", "RequestOutput", "SamplingParams"]
