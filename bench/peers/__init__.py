"""Kernel adapters of the side-by-side benches, one file per kernel family: ours, FlashMLA,
FA3 MLA, FlashInfer MLA, Triton MLA. Each `build*` function takes a config's inputs
(bench.dense_inputs.Inputs or bench.sparse_inputs.Case) and returns a common.Kernel; it
raises common.NotApplicable for a config the kernel does not serve. Peer libraries (vLLM's
kernels, FlashInfer) are imported inside the builders, so these modules import without them.
"""
