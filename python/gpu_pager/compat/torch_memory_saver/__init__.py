"""A drop-in for torch_memory_saver 0.0.10 on gpu_pager, for SGLang, slime and verl::

    from gpu_pager.compat.torch_memory_saver import torch_memory_saver

    with torch_memory_saver.region("weights", enable_cpu_backup=True):
        model = load_model()
    with torch_memory_saver.region("kv_cache"):
        kv = allocate_kv_cache()
    torch_memory_saver.pause("kv_cache")
    torch_memory_saver.pause("weights")
    torch_memory_saver.resume("weights")
    torch_memory_saver.resume("kv_cache")

To switch an engine without editing it, set ``GPU_PAGER_DROP_IN=torch_memory_saver`` in its
environment: ``import torch_memory_saver`` (and its submodules) then resolves to this
package (``gpu_pager._drop_in``, run at interpreter start by the wheel's ``.pth`` file).

Everything torch_memory_saver offers behaves as it does there: both hook modes ("preload",
the default, through ``configure_subprocess()`` and gpu-pager's preload library; "torch",
through torch's pluggable allocator), per-thread region configs, CPU backups in pinned or
"mmap" memory, disk backups, whole-process mode (``TMS_INIT_ENABLE=1``), ``disable()``,
``retain_cpu_backup``, ``get_cpu_backup``, the ``TMS_*`` environment variables and the
``tms_*`` C entry points. Differences, all on the safe side:

- Running out of memory on resume raises ``gpu_pager.OutOfMemoryError`` (a
  ``RuntimeError`` and a ``MemoryError``) and loses nothing: the tags stay paused with their
  backups, and a later ``resume`` succeeds (torch_memory_saver exits the process).
- Pausing or resuming twice does nothing (torch_memory_saver exits).
- A "pinned" CPU backup stays pinned across cycles (re-pinning costs 0.07-0.44 s per GiB),
  so a pause of weights that did not change copies nothing; ``get_cpu_backup`` still
  answers ``None`` after a resume that did not retain it, as torch_memory_saver does. The
  "mmap" backend gives its host memory back after each resume (unless retained).
- ``cuda_graph`` works in both hook modes (torch_memory_saver: "preload" only); in "torch"
  mode the graph's memory comes from the tag's pool, and a ``pool`` passed in is not used.
- An allocation inside a region whose tag is paused fails (``torch.OutOfMemoryError`` with
  the reason in ``gpu_pager.torch.last_error()``) instead of handing out memory that the
  pause already gave back.
"""

from gpu_pager.compat.torch_memory_saver.entrypoint import TorchMemorySaver
from gpu_pager.compat.torch_memory_saver.hooks.mode_preload import configure_subprocess

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess"]

torch_memory_saver = TorchMemorySaver()
"""The process's instance, as ``torch_memory_saver.torch_memory_saver``."""
