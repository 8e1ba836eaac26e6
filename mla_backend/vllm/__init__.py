"""vLLM adapters: backend classes, metadata builders and impls that translate vLLM's
attention metadata into mla_backend.ops calls. registration.py registers the router by string
(the entry point calls it in every vLLM process); vLLM's worker imports the rest only after
`--attention-backend CUSTOM` selects us."""
