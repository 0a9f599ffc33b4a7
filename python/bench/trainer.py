"""The trainer's side of an RL step, side by side in one run: a model's fp32 weights, its
AdamW moments and its gradients (about 18.7 GiB at the default size) paused and resumed
around every training step, as slime-style trainers do while the rollout engine has the GPU.

Implementations, each in its own process, one after the other on one GPU:

- ``reference``: the same training with no pause (its losses and final weights are what
  every other run must reproduce bit for bit);
- ``drop_in``: gpu_pager's torch_memory_saver drop-in, called as slime calls
  torch_memory_saver (a region with CPU backup around the model's and the optimizer's
  creation and growth, ``pause()``/``resume()`` of every tag);
- ``drop_in_prepin``: the same with ``GPU_PAGER_PREPIN=1`` (the ``prepin`` setting: every
  pinned backup is pinned as torch allocates the buffer, so the first pause pins nothing);
- ``gpu_pager``: ``gpu_pager.torch`` (``use``/``release``/``resume``);
- ``gpu_pager_prepin``: the same with ``use(..., prepin=True)``: each buffer's backup is
  pinned when torch allocates it, so the first pause pins nothing; the cost moves to the
  model's creation and the first step (the table's "setup + first step" column);
- ``torch_memory_saver``: torch_memory_saver 0.0.10 itself, called as the drop-in is.

Each runs twice: gradients kept with the rest (``keep``), and gradients in a tag of their own
whose contents are not kept (``discard``: the drop-ins' ``enable_cpu_backup=False``,
``gpu_pager.torch``'s ``discard_zeroed``), since every step zeroes them before its backward.

The model is a stack of MLP blocks (LayerNorm, Linear d→4d, GELU, Linear 4d→d), created on
the GPU under a fixed seed; gradients are allocated once before the first step (as
Megatron's grad buffers are) and the fused AdamW's moments grow at the first
``optimizer.step()``. Kernels are deterministic (``torch.use_deterministic_algorithms``,
``CUBLAS_WORKSPACE_CONFIG``). Figures sit next to the pinned link measured in the same
process; the ratio's limit is the bytes kept (weights and moments, plus gradients when
kept) over the link.

    python trainer.py                      # all of them; prints a Markdown table
    python trainer.py --impls gpu_pager --steps 4 --state-gib 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from side_by_side import exit_child, link, warm_host

GIB = 1 << 30
IMPLS = ("drop_in", "drop_in_prepin", "gpu_pager", "gpu_pager_prepin", "torch_memory_saver")


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Saver:
    """The calls a trainer makes, one implementation behind them."""

    def __init__(self, impl: str, grads: str) -> None:
        self.impl, self.grads = impl, grads
        self.report: Any = None
        if impl in ("drop_in", "drop_in_prepin", "torch_memory_saver"):
            if impl == "drop_in_prepin":
                os.environ["GPU_PAGER_PREPIN"] = "1"  # read when the pager is created
            if impl.startswith("drop_in"):
                from gpu_pager.compat.torch_memory_saver import torch_memory_saver as tms
            else:
                from torch_memory_saver import torch_memory_saver as tms  # type: ignore[no-redef]
            # First: torch_memory_saver starts in its default (preload) mode at the first
            # other attribute it is asked for. No LD_PRELOAD; one allocator path for all three.
            tms.hook_mode = "torch"
            if impl == "torch_memory_saver":
                tms.retain_cpu_backup = True  # keeps its pinned backup: its fast configuration
            self.tms: Any = tms
        elif impl in ("gpu_pager", "gpu_pager_prepin"):
            import gpu_pager.torch as gpt

            self.gpt: Any = gpt

    @contextmanager
    def state(self) -> Iterator[None]:
        """Where the weights and the optimizer's moments are allocated."""
        if self.impl == "reference":
            yield
        elif self.impl.startswith("gpu_pager"):
            with self.gpt.use("train", prepin=self.impl == "gpu_pager_prepin"):
                yield
        else:
            with self.tms.region("train", enable_cpu_backup=True):
                yield

    def grads_region(self) -> Any:
        """Where the gradients are allocated."""
        if self.impl == "reference" or self.grads == "keep":
            return self.state()
        if self.impl.startswith("gpu_pager"):
            return self.gpt.use("grads", "discard_zeroed")
        return self.tms.region("grads", enable_cpu_backup=False)

    def tags(self) -> list[str]:
        return ["train"] + (["grads"] if self.grads == "discard" else [])

    def pause(self) -> None:
        if self.impl.startswith("gpu_pager"):
            self.report = self.gpt.release(self.tags())
        else:
            self.tms.pause()

    def resume(self) -> None:
        if self.impl.startswith("gpu_pager"):
            self.report = self.gpt.resume(self.tags())
        else:
            self.tms.resume()


def run_one(impl: str, grads: str, state_bytes: int, steps: int, tokens: int, width: int) -> dict[str, Any]:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.use_deterministic_algorithms(True)
    saver = Saver(impl, grads)
    h2d, d2h = link(torch)
    _log(f"{impl}/{grads}: link h2d {h2d / 1e9:.1f} GB/s, d2h {d2h / 1e9:.1f} GB/s")

    per_block = 2 * width * 4 * width + 4 * width + width + 2 * width  # two Linears and a LayerNorm
    blocks = max(1, round(state_bytes / (16 * per_block)))  # weight, grad, two moments: 16 B each
    torch.manual_seed(0)
    t = time.perf_counter()
    with saver.state():
        model = torch.nn.Sequential(*[
            torch.nn.Sequential(
                torch.nn.LayerNorm(width, device="cuda"),
                torch.nn.Linear(width, 4 * width, device="cuda"),
                torch.nn.GELU(),
                torch.nn.Linear(4 * width, width, device="cuda"),
            )
            for _ in range(blocks)
        ])
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    with saver.grads_region():
        for p in params:
            p.grad = torch.zeros_like(p)
    torch.cuda.synchronize()
    made = time.perf_counter() - t
    n_params = sum(p.numel() for p in params)
    _log(f"{impl}/{grads}: {blocks} blocks, {len(params)} parameters, {n_params * 4 / GIB:.2f} GiB "
         f"of fp32 weights, made in {made:.1f} s")

    def step(i: int) -> float:
        gen = torch.Generator(device="cuda").manual_seed(1000 + i)
        x = torch.randn(tokens, width, device="cuda", generator=gen)
        target = torch.randn(tokens, width, device="cuda", generator=gen)
        optimizer.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        with saver.state():  # the moments grow here at the first step
            optimizer.step()
        value = float(loss.item())
        del x, target, loss
        torch.cuda.empty_cache()  # activations, as slime's clear_memory() before a pause
        return value

    def checksum() -> int:
        return sum(int(p.detach().view(torch.int32).to(torch.int64).sum()) for p in params)

    def timed(f: Callable[[], None]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    rows: dict[str, list[float]] = {}
    losses = []
    for i in range(steps):
        t0 = time.perf_counter()
        losses.append(step(i))
        if i == 0:
            torch.cuda.synchronize()
            rows["setup + first step"] = [made + time.perf_counter() - t0]
        if impl == "reference":
            continue
        pause = timed(saver.pause)
        if saver.report is not None:
            _log(f"{impl}/{grads} step {i}: pause {pause * 1e3:.0f} ms; {saver.report}")
        time.sleep(0.5)
        resume = timed(saver.resume)
        if saver.report is not None:
            _log(f"{impl}/{grads} step {i}: resume {resume * 1e3:.0f} ms; {saver.report}")
        rows.setdefault("first pause" if i == 0 else "pause", []).append(pause)
        rows.setdefault("first resume" if i == 0 else "resume", []).append(resume)
        _log(f"{impl}/{grads} step {i}: loss {losses[-1]:.6f}, pause {pause * 1e3:.0f} ms, "
             f"resume {resume * 1e3:.0f} ms")
    moments = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                  for v in s.values() if torch.is_tensor(v) and v.is_cuda)
    weights = n_params * 4
    kept = weights + moments + (weights if grads == "keep" else 0)
    return {
        "impl": impl, "grads": grads, "h2d": h2d, "d2h": d2h, "rows": rows,
        "losses": [float.hex(v) for v in losses], "checksum": checksum(),
        "weights_bytes": weights, "moments_bytes": moments, "kept_bytes": kept,
        "tensors": len(params),
    }


def table(results: list[dict[str, Any]], reference: dict[str, Any]) -> str:
    r0 = results[0]
    lines = [
        f"{r0['weights_bytes'] / GIB:.2f} GiB of fp32 weights in {r0['tensors']} tensors, as much in "
        f"gradients, {r0['moments_bytes'] / GIB:.2f} GiB of AdamW moments; "
        f"{len(reference['losses'])} steps, a pause and a resume after each; the run without pauses: "
        f"setup + first step {statistics.median(reference['rows'].get('setup + first step', [float('nan')])):.3f} s.",
        "",
        "| implementation | gradients | GiB kept | first pause s (× link) | pause s (× link) | "
        "resume s (× link) | first resume s | setup + first step s | link d2h/h2d GB/s | bit-exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        d2h_limit = r["kept_bytes"] / r["d2h"]
        h2d_limit = r["kept_bytes"] / r["h2d"]

        def cell(name: str, limit: float, rows: dict[str, list[float]] = r["rows"]) -> str:
            xs = rows.get(name, [])
            if not xs:
                return "—"
            med = statistics.median(xs)
            return f"{med:.3f} ({med / limit:.2f}×)"

        exact = r["losses"] == reference["losses"] and r["checksum"] == reference["checksum"]
        lines.append(
            f"| {r['impl']} | {r['grads']} | {r['kept_bytes'] / GIB:.2f} | {cell('first pause', d2h_limit)} | "
            f"{cell('pause', d2h_limit)} | {cell('resume', h2d_limit)} | "
            f"{statistics.median(r['rows'].get('first resume', [float('nan')])):.3f} | "
            f"{statistics.median(r['rows'].get('setup + first step', [float('nan')])):.3f} | "
            f"{r['d2h'] / 1e9:.1f}/{r['h2d'] / 1e9:.1f} | {'yes' if exact else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=("reference",) + IMPLS, help="one child run")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--grads", default="keep,discard")
    ap.add_argument("--json")
    ap.add_argument("--state-gib", type=float, default=18.7,
                    help="weights, gradients and both moments together")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--width", type=int, default=2048)
    args = ap.parse_args()
    sb = int(args.state_gib * GIB)
    if args.impl:
        grads = args.grads.split(",")[0]
        exit_child(run_one(args.impl, grads, sb, args.steps, args.tokens, args.width), args.json)

    def child(impl: str, grads: str) -> dict[str, Any] | None:
        out = f"/tmp/trainer_{impl}_{grads}.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--impl", impl, "--grads", grads,
               "--json", out, "--state-gib", str(args.state_gib), "--steps", str(args.steps),
               "--tokens", str(args.tokens), "--width", str(args.width)]
        done = subprocess.run(cmd)
        if done.returncode != 0:
            _log(f"{impl}/{grads} failed with exit code {done.returncode}")
            return None
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
        return result

    # The first implementation would otherwise pay a fresh machine's first touch of host
    # memory (BENCHMARKS.md, the side-by-side table).
    t = time.perf_counter()
    warm_host(int(sb * 1.1))
    _log(f"touched {sb * 1.1 / GIB:.1f} GiB of host memory in {time.perf_counter() - t:.1f} s")
    reference = child("reference", "keep")
    if reference is None:
        return 1
    results = []
    failed = False
    for grads in args.grads.split(","):
        for impl in args.impls.split(","):
            r = child(impl, grads)
            if r is None:
                failed = True
            else:
                results.append(r)
                # Each row as it comes, so that a run cut short still says what it measured.
                print(table([r], reference).splitlines()[-1], flush=True)
    if results:
        print(table(results, reference))
    return 1 if failed or any(r["checksum"] != reference["checksum"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
