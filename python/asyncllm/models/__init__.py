"""Models: the registry (`registry`), config reading (`hf_config`), weight loading
(`loader`), the layers (`layers`), paged attention (`attention`, which also
documents the KV-cache layout) and the Llama family (`llama`). Import the module
you need: this package imports nothing, so reading a config stays torch-free."""
