"""The engine: loading models, generating, measuring, the bench, tensor parallelism."""
