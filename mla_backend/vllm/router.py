"""The class registered for `AttentionBackendEnum.CUSTOM`.

vLLM has one CUSTOM slot, and a backend class is either dense or sparse (`is_sparse()` takes
no arguments). vLLM selects a backend in `CudaPlatform.get_attn_backend_cls`: it calls
`validate_configuration(use_sparse=..., ...)` on the registered class and then uses the class
named by its `full_cls_name()`. The router answers both: it validates with the backend that
fits the layer (dense MLA, or sparse MLA for DeepSeek-V3.2) and names that backend, so vLLM
works with the concrete class from then on. The choice is made per `validate_configuration`
call, which vLLM makes immediately before `full_cls_name()`.
"""

from __future__ import annotations

from typing import ClassVar

from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.attention.backend import AttentionBackend

from . import support, version

DENSE_BACKEND = "mla_backend.vllm.dense.MLADenseBackend"
SPARSE_BACKEND = "mla_backend.vllm.sparse.MLASparseBackend"


class MLABackendRouter(AttentionBackend):
    """Delegates selection to the dense or the sparse mla_backend backend."""

    _selected: ClassVar[type[AttentionBackend] | None] = None

    @staticmethod
    def get_name() -> str:
        return support.NAME

    @classmethod
    def backend_for(cls, use_mla: bool, use_sparse: bool) -> type[AttentionBackend] | None:
        if not use_mla:
            return None
        return resolve_obj_by_qualname(SPARSE_BACKEND if use_sparse else DENSE_BACKEND)

    @classmethod
    def validate_configuration(cls, **selector_config) -> list[str]:
        unsupported = version.unsupported_reason()
        if unsupported:  # before importing an adapter written for another interface
            return [unsupported]
        use_mla = bool(selector_config.get("use_mla"))
        use_sparse = bool(selector_config.get("use_sparse"))
        if not use_mla:
            return [support.NOT_MLA_REASON]
        backend = cls.backend_for(use_mla, use_sparse)
        reasons = backend.validate_configuration(**selector_config)
        if not reasons:
            cls._selected = backend
        return reasons

    @classmethod
    def full_cls_name(cls) -> tuple[str, str]:
        if cls._selected is None:
            raise RuntimeError(
                "mla_backend's CUSTOM router names a backend only after vLLM validated one "
                "(AttentionBackendEnum.CUSTOM.get_class().validate_configuration(...))")
        return cls._selected.full_cls_name()

    # The router is never used as a backend itself: vLLM continues with the class that
    # full_cls_name() names.
    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("use the backend named by full_cls_name()")

    @staticmethod
    def get_builder_cls():
        raise NotImplementedError("use the backend named by full_cls_name()")

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                           cache_dtype_str="auto"):
        raise NotImplementedError("use the backend named by full_cls_name()")
