"""vLLM adapters: backend classes, metadata builders and impls that translate vLLM's
attention metadata into mla_backend.ops calls. Imported by vLLM's worker only after
`--attention-backend CUSTOM` selects us (plugin_entry registers the router by string)."""
