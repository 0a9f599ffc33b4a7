"""The engine parts of vLLM that its sleep path imports but that need a whole engine or a
model, standing in beside the release's own files (scripts/engines-extract puts those over
this tree): gpu_pager's checks drive each release's own allocator, backends and worker
methods with them. Not vLLM's code. ``__version__`` is the release's (its ``VERSION``)."""

import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
try:
    with open(_os.path.join(_here, "..", "VERSION")) as _f:
        __version__ = _f.read().strip()
except OSError:
    __version__ = "0.0.0"
