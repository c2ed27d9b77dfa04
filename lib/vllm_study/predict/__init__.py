"""Predicting a configuration without starting it: vLLM's own scheduler and KV cache
manager driven in virtual time (``simulator``), each step's duration from a step-time
model fitted to the step records of the kit's real starts (``step_model``)."""
