"""``vllm.platforms.current_platform`` for CUDA."""


class _Cuda:
    device_type = "cuda"
    device_name = "cuda"

    def is_cuda(self):
        return True

    def is_cuda_alike(self):
        return True

    def is_rocm(self):
        return False

    def is_xpu(self):
        return False

    def is_cpu(self):
        return False

    def graph_pool_handle(self):
        import torch

        return torch.cuda.graph_pool_handle()


current_platform = _Cuda()
