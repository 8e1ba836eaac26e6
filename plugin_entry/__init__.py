"""Entry-point functions for serving frameworks. Nothing heavy is imported here: these run
in every vLLM process (API server included), before CUDA is initialised."""
