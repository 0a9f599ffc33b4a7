"""``vllm.utils``: only the modules the sleep path imports."""
