"""The OpenAI-compatible HTTP server (`asyncllm serve`; the command line is `cli/`).

Map: `app.py` (routes, auth and admission, errors, lifespan), `protocol.py`
(request models and their sampling parameters, the error type), `serving_*.py`
(one endpoint family each over `serving_base.py`), `sse.py` (streamed chunks from
preformatted bytes), `chat_template.py`, `metrics.py` (Prometheus), `launch.py`
(uvicorn and graceful shutdown).
"""
