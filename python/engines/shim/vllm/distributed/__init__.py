"""A package of the vLLM stand-in (see vllm/__init__.py)."""
