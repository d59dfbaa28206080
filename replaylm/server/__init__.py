"""The OpenAI-compatible HTTP server (``replaylm serve``).

Nothing is imported here on purpose: the server needs the optional ``server`` extra (FastAPI,
uvicorn, prometheus-client), and the rest of replaylm must work without it.

- ``protocol``: request bodies (pydantic), validation errors, ``SamplingParams`` mapping;
- ``engine_loop``: the one background thread that owns and drives the engine;
- ``metrics``: Prometheus export of the engine's stats and the server's latencies;
- ``responses``: OpenAI response and stream-chunk shapes;
- ``app``: the FastAPI application; ``serve``: the command and graceful shutdown.
"""
