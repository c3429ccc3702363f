"""Models: the registry (`registry`), config reading (`hf_config`, which also says
each layer's sliding window), weight loading (`loader`), the layers (`layers`),
paged attention (`attention`, which also documents the KV-cache layout), the Llama
family (`llama`) and the families built on it: `qwen3`, `phi3`, `gemma`, the
mixture-of-experts MLP (`moe`) with `mixtral` and `qwen_moe`. Import the module you
need: this package imports nothing, so reading a config stays torch-free."""
