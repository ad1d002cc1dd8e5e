"""prefixcache: an LLM inference engine built around automatic prefix caching."""

__version__ = "0.1.0"
