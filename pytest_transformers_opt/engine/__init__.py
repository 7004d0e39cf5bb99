"""The engine: the hardware probe, loading models, generating, measuring, tensor parallelism, the built-in models."""
