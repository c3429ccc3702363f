"""The front end: tokenizing and validating input, turning engine-core outputs into
`RequestOutput`s, and the user-facing `LLM` API. It never runs the model."""
