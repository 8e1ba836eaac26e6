"""mla_backend: native CUDA MLA kernels for Hopper, and their float32 references.

    import mla_backend.ops as ops          # kernels (need the built extension and a Hopper GPU)
    import mla_backend.reference as ref    # float32/float64 PyTorch references (any device)
    import mla_backend.formats as fmt      # KV-cache token formats (fp8_ds_mla, per-tensor fp8)

mla_backend.vllm holds the vLLM backend; mla_backend.demo (`python -m mla_backend.demo`) runs
it against vLLM's own backend, end to end.
"""

__version__ = "0.1.0"
