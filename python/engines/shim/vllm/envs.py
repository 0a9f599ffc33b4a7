"""``vllm.envs``: the variables the sleep path reads, from the environment as vLLM reads them."""

import os

VLLM_CUDART_SO_PATH = os.environ.get("VLLM_CUDART_SO_PATH")
VLLM_PLUGINS = os.environ["VLLM_PLUGINS"].split(",") if "VLLM_PLUGINS" in os.environ else None
