"""The `asyncllm` command line: `main.py` dispatches to one module per subcommand
(`serve.py`, `generate.py`, `bench.py`), which share the flags of `args.py`.

It sits above every other package (it starts servers and engines); nothing in the
library imports it.
"""
