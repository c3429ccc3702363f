"""The OpenAI- and Anthropic-compatible HTTP server (`asyncllm serve`; the command
line is `cli/`).

Map: `app.py` (routes, auth and admission, errors, lifespan), `protocol.py`
(request models and their sampling parameters, the error type), `serving_*.py`
(one endpoint family each over `serving_base.py`), `sse.py` (streamed chunks from
preformatted bytes), `chat_template.py`, `metrics.py` (Prometheus), `launch.py`
(uvicorn and graceful shutdown). `/v1/responses` and `/v1/messages` translate
their requests into chat requests (`protocol_responses.py`,
`protocol_messages.py`), run them as one turn (`turn.py`) and render each API's
shape (`responses_output.py`, `serving_messages.py`); `response_store.py` keeps
stored responses. Model output is read by `output_parser.py`: the reasoning
parser (`reasoning/`) first, then the tool parser (`tool_parsers/`).
"""
