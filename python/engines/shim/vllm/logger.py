"""``vllm.logger.init_logger``: a ``logging`` logger with vLLM's ``*_once`` methods."""

import functools
import logging
from typing import Any


class _Logger(logging.LoggerAdapter[logging.Logger]):
    @functools.cache  # noqa: B019 (once per message, as vLLM's)
    def warning_once(self, msg: str, *args: Any) -> None:
        self.warning(msg, *args)

    @functools.cache  # noqa: B019
    def info_once(self, msg: str, *args: Any) -> None:
        self.info(msg, *args)

    @functools.cache  # noqa: B019
    def debug_once(self, msg: str, *args: Any) -> None:
        self.debug(msg, *args)


def init_logger(name: str) -> _Logger:
    return _Logger(logging.getLogger(name), {})
