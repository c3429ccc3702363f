"""GGUF weights kept in their blocks: dequantization (`dequant`), the layers that
compute on blocks (`layers`), the file's tensors by checkpoint name (`tensors`)
and the loader (`loader`)."""
