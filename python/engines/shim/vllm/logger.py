"""``vllm.logger.init_logger``: a ``logging`` logger with vLLM's ``*_once`` methods."""

import functools
import logging


class _Logger(logging.LoggerAdapter):
    @functools.cache  # noqa: B019 (once per message, as vLLM's)
    def warning_once(self, msg, *args):
        self.warning(msg, *args)

    @functools.cache  # noqa: B019
    def info_once(self, msg, *args):
        self.info(msg, *args)

    @functools.cache  # noqa: B019
    def debug_once(self, msg, *args):
        self.debug(msg, *args)


def init_logger(name):
    return _Logger(logging.getLogger(name), {})
