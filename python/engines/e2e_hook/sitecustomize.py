"""On PYTHONPATH of ``e2e.py``'s SGLang runs with ``E2E_HOOK_MODE=torch``: every process sets
torch_memory_saver's ``hook_mode = "torch"`` at start (SGLang 0.5.12 has no setting for it; a
framework that wants the mode sets it so), before SGLang's scheduler first uses it."""

import os

if os.environ.get("E2E_HOOK_MODE") == "torch":
    import torch_memory_saver

    torch_memory_saver.torch_memory_saver.hook_mode = "torch"
