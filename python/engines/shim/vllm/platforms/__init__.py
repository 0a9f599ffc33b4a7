"""``vllm.platforms.current_platform`` for CUDA."""

from typing import Any


class _Cuda:
    device_type = "cuda"
    device_name = "cuda"

    def is_cuda(self) -> bool:
        return True

    def is_cuda_alike(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False

    def graph_pool_handle(self) -> Any:
        import torch

        return torch.cuda.graph_pool_handle()


current_platform = _Cuda()
