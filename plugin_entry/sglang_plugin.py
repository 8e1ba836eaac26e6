"""SGLang `sglang.srt.plugins` entry point (installed as mla_backend_entry.sglang_plugin).

SGLang calls `register()` in every process (launcher, Engine, each scheduler) before it parses
arguments; it stays cheap (mla_backend.sglang.registration)."""

from mla_backend.sglang.registration import register

__all__ = ["register"]
