"""vllm_study: reproducible studies of vLLM serving knobs, driven by papermill notebooks."""
__version__ = "0.1.0"
