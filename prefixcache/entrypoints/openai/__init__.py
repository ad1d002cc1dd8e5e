"""The OpenAI-compatible server (``prefixcache serve``).

Modules: ``protocol`` (request and response bodies), ``errors`` (OpenAI error JSON),
``tenancy`` (API keys, tenants, cache salts), ``metrics`` (Prometheus), ``serving``
(requests to engine requests and back), ``api_server`` (the FastAPI app) and ``serve_cmd``
(the command line). Importing this package imports none of them.
"""
