"""Adapters between vLLM's attention-backend interface and mla_backend.ops."""
