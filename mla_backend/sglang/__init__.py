"""mla_backend in SGLang 0.5.17: `--attention-backend mla_backend`.

    registration.py  register(): the backend name, its factory, the page-size hooks (cheap)
    factory.py       configuration checks, DeepSeek-side policy, the backend instance
    dense.py         the dense MLA backend (decode / verify / draft-extend on our kernel)
    metadata.py      ForwardBatch -> key lengths and page table (pure tensor code)
    dsa.py           the DSA backend (DeepSeek-V3.2: every token's sparse attention on our
                     kernel, SGLang's indexer and its metadata kept)
    sparse_index.py  top-k positions / slots -> the cache slots each query token reads
    support.py       what is accepted, as messages
"""
