"""The end-to-end demo and its harness, apart from the kernels: `python -m mla_backend.demo`
(__main__.py) runs vLLM with our backend and with vLLM's own on the same prompts.
engines.py starts each engine in its own process (engine_run.py) and compares their outputs;
tiny_model.py writes a small DeepSeek checkpoint, so nothing is downloaded."""
