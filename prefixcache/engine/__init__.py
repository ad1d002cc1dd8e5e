"""prefixcache.engine — the synchronous engine (:class:`LLMEngine`), sampling and outputs.

``prefixcache.engine.llm_engine`` (which loads torch) is not imported here; outputs and
sampling params are plain dataclasses.
"""

from prefixcache.engine.outputs import RequestMetrics, RequestOutput
from prefixcache.engine.sampling_params import SamplingParams

__all__ = ["RequestMetrics", "RequestOutput", "SamplingParams"]
