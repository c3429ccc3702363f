"""The OpenAI-compatible HTTP server (`asyncllm serve`) and the `asyncllm` CLI.

Map: `app.py` (routes, auth and admission, errors, lifespan), `protocol.py`
(request models and their sampling parameters, the error type), `serving_*.py`
(one endpoint family each over `serving_base.py`), `sse.py` (streamed chunks from
preformatted bytes), `chat_template.py`, `metrics.py` (Prometheus), `launch.py`
(uvicorn and graceful shutdown), `cli.py`, `bench.py`.
"""
