"""``sglang.srt.utils.common.is_xpu``: these checks run on CUDA."""


def is_xpu() -> bool:
    return False
