"""What the multi-GPU e2e tests read from an engine besides its outputs: which of vLLM's
worker ranks logged a line (vLLM 0.25 prefixes every line a worker prints with its process
name, `(Worker_TP1_DCP1 pid=4242) `, once the parallel groups exist: multiproc_executor's
setup_proc_title_and_log_prefix, before the model and its attention backend are built), the
ranks an engine has, and how far a reference's logprobs are from uniform."""

from __future__ import annotations

import math
import re
import statistics

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PREFIX = re.compile(r"\((Worker(?:_[A-Z]+\d+)*) pid=\d+\) ")
CUSTOM_SELECTED = "Using AttentionBackendEnum.CUSTOM backend."  # platforms/cuda.py, per worker
MIN_ABOVE_UNIFORM = 1.0  # nats: the reference's median top-1 logprob above -ln(vocab)


def rank_names(tp: int, dcp: int = 1) -> list[str]:
    """vLLM's worker process names for tensor-parallel size tp and decode-context-parallel
    size dcp (DCP splits each TP group: rank r has DCP rank r % dcp)."""
    return [f"Worker_TP{r}" + (f"_DCP{r % dcp}" if dcp > 1 else "") if tp > 1 else "Worker"
            for r in range(tp)]


def ranks_logging(log: str, text: str) -> dict[str, int]:
    """How many lines containing text each worker process name printed."""
    found: dict[str, int] = {}
    for line in _ANSI.sub("", log).splitlines():
        m = _PREFIX.search(line)
        if m and text in line[m.end():]:
            found[m.group(1)] = found.get(m.group(1), 0) + 1
    return found


def missing_ranks(log: str, text: str, tp: int, dcp: int = 1) -> list[str]:
    """The worker ranks (rank_names) that printed no line containing text."""
    found = ranks_logging(log, text)
    return [name for name in rank_names(tp, dcp) if name not in found]


def above_uniform(outputs: list[dict], vocab: int) -> float:
    """Median over every generated position of the top-1 logprob + ln(vocab): 0 for a model
    whose every token is equally likely (vLLM's dummy weights give that), against which any
    two kernels agree."""
    top1 = [pos[0][1] for out in outputs for pos in out["logprobs"] if pos]
    if not top1:
        raise ValueError("no logprobs in the outputs")
    return statistics.median(top1) + math.log(vocab)
