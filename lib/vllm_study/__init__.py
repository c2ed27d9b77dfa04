"""vllm_study: reproducible studies of vLLM serving knobs, driven by papermill notebooks."""
