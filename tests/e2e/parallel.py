"""What the multi-GPU e2e tests read from an engine besides its outputs: which of vLLM's
worker ranks logged a line, the ranks an engine has, and how far a reference's logprobs are
from uniform.

vLLM 0.25 prefixes what a worker prints with its process name, `(Worker_TP1_DCP1 pid=4242) `,
once the parallel groups exist (multiproc_executor's setup_proc_title_and_log_prefix, before
the model and its attention backend are built). The prefix and the line are two writes, so
two ranks logging at the same moment can interleave them in a shared log. PID_TAG_ENV puts
the process id into the log record itself (vLLM inserts VLLM_LOGGING_PREFIX into its log
format), one write with the text; a line is then credited to the worker whose prefix carries
that pid elsewhere in the log.
"""

from __future__ import annotations

import math
import re
import statistics

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PREFIX = re.compile(r"\((Worker(?:_[A-Z]+\d+)*) pid=(\d+)\) ")
_PID_TAG = re.compile(r"\[pid (\d+)\] ")
PID_TAG_ENV = {"VLLM_LOGGING_PREFIX": "[pid %(process)d] "}
CUSTOM_SELECTED = "Using AttentionBackendEnum.CUSTOM backend."  # platforms/cuda.py, per worker
MIN_ABOVE_UNIFORM = 1.0  # nats: the reference's median top-1 logprob above -ln(vocab)


def rank_names(tp: int, dcp: int = 1) -> list[str]:
    """vLLM's worker process names for tensor-parallel size tp and decode-context-parallel
    size dcp (DCP splits each TP group: rank r has DCP rank r % dcp)."""
    return [f"Worker_TP{r}" + (f"_DCP{r % dcp}" if dcp > 1 else "") if tp > 1 else "Worker"
            for r in range(tp)]


def ranks_logging(log: str, text: str) -> dict[str, int]:
    """How many log records containing text each worker process name printed: by the pid tag
    of the record (PID_TAG_ENV) where there is one, else by the worker prefix before it."""
    clean = _ANSI.sub("", log)
    names = {int(m.group(2)): m.group(1) for m in _PREFIX.finditer(clean)}
    found: dict[str, int] = {}
    for line in clean.splitlines():
        at = line.find(text)
        if at < 0:
            continue
        tags = list(_PID_TAG.finditer(line, 0, at))
        if tags:
            name = names.get(int(tags[-1].group(1)))
        else:
            prefixes = list(_PREFIX.finditer(line, 0, at))
            name = prefixes[-1].group(1) if prefixes else None
        if name is not None:
            found[name] = found.get(name, 0) + 1
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
