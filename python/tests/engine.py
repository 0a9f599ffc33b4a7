"""A small rollout engine, as SGLang or vLLM hold one, for the GPU scenarios: a Llama
decoder from transformers with random weights (parameters, and the rotary ``inv_freq``
buffers that are not parameters), its static KV cache, and one decode step captured in a
CUDA graph. Where each part's memory comes from is the caller's (the ``Placement``).

Not a test module: imported by ``test_engine_cuda.py`` and run as a script by the
two-process test (``python engine.py SIZE CYCLES``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

SIZES: dict[str, dict[str, int]] = {
    # ~0.33 GB of bf16 weights
    "small": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
    # ~3.4 GB of bf16 weights
    "large": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
}
PROMPT = 16
MAX_LEN = 256
BATCH = 4


def _none() -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclass
class Placement:
    """Where each part of the engine allocates: context managers entered around building
    the model (``weights``), the KV cache's first use (``kv``) and the graph capture
    (``graph(cuda_graph)``, which must itself capture, like ``torch.cuda.graph``)."""

    weights: Callable[[], contextlib.AbstractContextManager[Any]] = _none
    kv: Callable[[], contextlib.AbstractContextManager[Any]] = _none
    graph: Callable[[Any], contextlib.AbstractContextManager[Any]] = field(
        default=lambda g: torch.cuda.graph(g)
    )


class Engine:
    """The model, its KV cache and a captured decode step."""

    def __init__(self, size: str, place: Placement, seed: int = 0) -> None:
        config = LlamaConfig(max_position_embeddings=MAX_LEN, **SIZES[size])
        config._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        with place.weights(), torch.device("cuda"):
            self.model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
        self.cache = StaticCache(config=config, max_cache_len=MAX_LEN)
        gen = torch.Generator().manual_seed(seed + 1)
        self.prompt = torch.randint(0, config.vocab_size, (BATCH, PROMPT), generator=gen).cuda()
        # Static inputs of the graph: ordinary torch memory, always resident.
        self.token = torch.randint(0, config.vocab_size, (BATCH, 1), generator=gen).cuda()
        self.position = torch.full((1,), PROMPT, dtype=torch.long, device="cuda")
        # The keys and values and nothing else under the KV placement, as an engine places
        # its KV cache: a first forward pass there would also put cuBLAS's workspace and the
        # cache layers' other device state under the KV tag, which a discard then loses (the
        # audit lists such allocations; poisoned, that state made index_copy_ index out of
        # range).
        self.prefill()  # the static cache allocates its tensors on first use
        with place.kv():
            for layer in self.cache.layers:
                layer.keys = torch.zeros_like(layer.keys)
                layer.values = torch.zeros_like(layer.values)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up outside the capture
                self.decode()
        torch.cuda.current_stream().wait_stream(side)
        self.prefill()
        with place.graph(self.graph):
            self.logits = self.decode()

    def prefill(self) -> torch.Tensor:
        """Runs the prompt through the model into the KV cache; returns its logits."""
        positions = torch.arange(PROMPT, device="cuda")
        with torch.no_grad():
            out = self.model(
                input_ids=self.prompt,
                past_key_values=self.cache,
                cache_position=positions,
                use_cache=True,
            )
        return out.logits

    def decode(self) -> torch.Tensor:
        with torch.no_grad():
            out = self.model(
                input_ids=self.token,
                past_key_values=self.cache,
                cache_position=self.position,
                position_ids=self.position.view(1, 1).expand(BATCH, 1),
                use_cache=True,
            )
        return out.logits

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill (eagerly; the KV cache is refilled) and one graph-replayed decode step:
        both logits, on the host. The cache is zeroed first, as between two generations:
        HF's static cache attends over all its positions with a mask, and after a resume of a
        ``discard`` tag the masked positions hold whatever the memory held (NaN patterns
        included, and 0 * NaN is NaN)."""
        self.cache.reset()
        prompt_logits = self.prefill().float().cpu()
        self.graph.replay()
        torch.cuda.synchronize()
        return prompt_logits, self.logits.float().cpu()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every device tensor the engine holds, by name: parameters, buffers, KV cache."""
        out = {f"param:{n}": p for n, p in self.model.named_parameters()}
        out.update({f"buffer:{n}": b for n, b in self.model.named_buffers()})
        for i, layer in enumerate(self.cache.layers):
            out[f"kv:{i}:keys"] = layer.keys
            out[f"kv:{i}:values"] = layer.values
        return out

    def addresses(self) -> dict[str, int]:
        return {n: int(t.data_ptr()) for n, t in self.tensors().items()}

    def parameters(self) -> list[torch.Tensor]:
        return [p for _, p in self.model.named_parameters()]

    def snapshot_parameters(self) -> list[torch.Tensor]:
        """Host copies of the parameters: the "new weights" an update writes back."""
        return [p.detach().cpu() for p in self.parameters()]

    def update(self, values: list[torch.Tensor]) -> None:
        """The trainer's weight update: overwrites every parameter in place."""
        with torch.no_grad():
            for p, v in zip(self.parameters(), values):
                p.copy_(v, non_blocking=False)
        torch.cuda.synchronize()

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters())


def gpt_placement(tags: dict[str, str]) -> Placement:
    """The engine's memory in three gpu_pager.torch tags: ``tags["weights"]`` (preserve),
    ``tags["kv"]`` (discard) and ``tags["graph"]`` (preserve, the decode graph's pool)."""
    import gpu_pager.torch as gpt

    w, kv, g = tags["weights"], tags["kv"], tags["graph"]
    return Placement(
        weights=lambda: gpt.use(w),
        kv=lambda: gpt.use(kv, "discard"),
        graph=lambda cg: gpt.graph(cg, g),
    )


def trainer_pass(margin: int = 4 << 30) -> None:
    """What the trainer does between release and resume: allocates most of the free memory
    (all but ``margin``, or the fraction ``GPU_PAGER_TRAINER_FRACTION`` of it when set:
    processes that share the GPU take less), writes it, frees it (plain torch memory)."""
    free, _ = torch.cuda.mem_get_info()
    fraction = os.environ.get("GPU_PAGER_TRAINER_FRACTION")
    n = int(free * float(fraction)) if fraction else free - margin
    n = max(n, 1 << 20)
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    x.fill_(7)
    torch.cuda.synchronize()
    del x
    torch.cuda.empty_cache()


@contextlib.contextmanager
def timed(label: str, out: dict[str, float]) -> Iterator[None]:
    t = time.perf_counter()
    yield
    out[label] = time.perf_counter() - t


def _main(argv: list[str]) -> int:
    """Standalone: the multi-stage wake-up through gpu_pager.torch, ``cycles`` times,
    checked bit-exact; prints one line per cycle. For the two-process test."""
    import gpu_pager.torch as gpt

    size, cycles = argv[0], int(argv[1])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # torchrun: a GPU per rank
    tags = {"weights": "weights", "kv": "kv_cache", "graph": "cuda_graph"}
    engine = Engine(size, gpt_placement(tags))
    want = engine.step()
    addresses = engine.addresses()
    for cycle in range(cycles):
        gpt.release(["kv_cache", "weights", "cuda_graph"])
        trainer_pass()
        gpt.resume("weights")
        gpt.resume(["kv_cache", "cuda_graph"])
        got = engine.step()
        ok = all(torch.equal(a, b) for a, b in zip(got, want))
        same = engine.addresses() == addresses
        print(f"cycle {cycle}: logits bit-exact {ok}, addresses unchanged {same}", flush=True)
        if not (ok and same):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
