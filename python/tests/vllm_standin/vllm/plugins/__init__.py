"""Stand-in for ``vllm.plugins``: runs every ``vllm.general_plugins`` entry point (those
that ``VLLM_PLUGINS`` names, when it is set), as vLLM does in each of its processes."""

import os
from importlib.metadata import entry_points


def load_general_plugins() -> None:
    allowed = os.environ.get("VLLM_PLUGINS")
    for ep in entry_points(group="vllm.general_plugins"):
        if allowed is None or ep.name in allowed.split(","):
            ep.load()()
