"""The parts of SGLang that its memory saver adapter imports but that need a whole engine,
standing in beside the release's own files (scripts/engines-extract puts those over this
tree). Not SGLang's code. ``__version__`` is the release's (its ``VERSION``)."""

import os as _os

try:
    with open(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "..", "VERSION")) as _f:
        __version__ = _f.read().strip()
except OSError:
    __version__ = "0.0.0"
