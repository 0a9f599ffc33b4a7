"""Stand-in for ``vllm.plugins``: runs every ``vllm.general_plugins`` entry point, as vLLM
does in each of its processes."""

from importlib.metadata import entry_points


def load_general_plugins() -> None:
    for ep in entry_points(group="vllm.general_plugins"):
        ep.load()()
