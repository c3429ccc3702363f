"""Constrained decoding, request side and runner side, in one place.

- `params.py`: `StructuredOutputsParams` (json, regex, choice, grammar), checked
  when built; what `SamplingParams.structured_outputs` holds and the wire carries.
- `openai_fields.py`: OpenAI's `response_format` and vLLM's `structured_outputs`
  request fields turned into those params, or a 400 naming the field.
- `grammar_cache.py`: grammars compiled by llguidance in the extension
  (`rust/structured/`), off the event loop and the busy loop, cached by spec.
- `rows.py`: the model runner's matchers, one per constrained request, and each
  step's token bitmask, filled on the extension's grammar thread
  (`rust/py/mask_job.rs`).

The sampler applies the masks (`_core._sample`'s bitmask; the torch sampler the
same); `worker/sampling_metadata.let_grammar_win` settles `min_tokens` against a
grammar that allows only EOS. The package is a leaf: it imports no engine layer,
so the front end, the server and the runner all use it.
"""
