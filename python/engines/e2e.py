"""The real engines on the GPU, stock and through gpu_pager's drop-ins: vLLM's ``LLM`` and
SGLang's ``Engine``, unmodified (packed by scripts/engine-pack), run a random-weight Llama with
CUDA graphs (and, in vLLM, torch.compile) through the multi-stage wake-up of an RL loop. Each
engine runs once per switch, each in its own processes; the only difference between runs is
the drop-in's switch. Prints one JSON row per check and call, a table per engine, and
``N passed, N failed``; exits non-zero when a check fails.

    python e2e.py PACKED_DIR [--only vllm sglang] [--work DIR] [--model-gib 5.4] [--out FILE]

PACKED_DIR holds ``<engine>-<version>.tar.xz`` (``.gpu/e2e``); each is unpacked once into
WORK (default /tmp/e2e), where the model is built once too.

Checks per run (``e2e_vllm.py``, ``e2e_sglang.py`` say what each does): the tokens after every
cycle are the reference's, token for token; the memory each sleep frees (NVML, device-wide);
each call's time. Across runs: the drop-in's tokens are stock's, its sleeps free at least
stock's memory, its sleep and wake calls take at most stock's time, and its weights stage
takes at most 1.10x the pinned link measured here (bytes of the weights / bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 1 << 30

RUNS: dict[str, tuple[str, tuple[tuple[str, dict[str, str]], ...]]] = {
    "vllm-0.24.0": (
        "e2e_vllm.py",
        (("stock", {}), ("drop-in", {"GPU_PAGER_DROP_IN": "vllm"})),
    ),
    "sglang-0.5.12": (
        "e2e_sglang.py",
        (
            ("stock", {}),
            ("drop-in preload", {"GPU_PAGER_DROP_IN": "torch_memory_saver", "E2E_HOOK_MODE": "preload"}),
            ("drop-in torch", {"GPU_PAGER_DROP_IN": "torch_memory_saver", "E2E_HOOK_MODE": "torch"}),
        ),
    ),
}
"""Engine -> (its child script, its runs: name and the environment that differs)."""

LINK_LIMIT = 1.10
"""The weights' stage (a wake-up of the weights) may take this multiple of the link's time."""


def log(msg: str) -> None:
    print(f"e2e [{time.strftime('%T')}] {msg}", file=sys.stderr, flush=True)


def unpack(archive: str, work: str) -> str:
    """``archive``'s ``site/`` under WORK/<name>, once; returns the site directory."""
    name = os.path.basename(archive).removesuffix(".tar.xz")
    dest = os.path.join(work, name)
    site = os.path.join(dest, "site")
    done = os.path.join(dest, ".unpacked")
    if not os.path.exists(done):
        log(f"unpacking {os.path.basename(archive)} ...")
        with tarfile.open(archive, "r:xz") as t:
            t.extractall(dest, filter="fully_trusted")
        open(done, "w").close()
    return site


def build_model(path: str, gib: float) -> None:
    """A random-weight Llama of about ``gib`` GiB in bf16, saved as safetensors (once): 4096
    wide, GQA 32/8 heads of 128, an MLP of 14336, as many layers as the size asks."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    per_layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
    layers = max(1, round((gib * GIB / 2 - 2 * 32000 * 4096) / per_layer))
    config = LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        dtype="bfloat16",
    )
    log(f"building a random Llama of {layers} layers into {path} ...")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    model.save_pretrained(path, max_shard_size="2GB")
    del model
    torch.cuda.empty_cache()


def link(nbytes: int) -> dict[str, float]:
    """The pinned link's bandwidth each way (bytes/s), best of 5 copies of ``nbytes`` (at most
    4 GiB), in a child process so that this one holds no CUDA context."""
    code = f"""
import json, torch
n = min({nbytes}, 4 << 30)
h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
d = torch.empty(n, dtype=torch.uint8, device="cuda")
out = {{}}
for name, dst, src in (("h2d", d, h), ("d2h", h, d)):
    best = 1e9
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); dst.copy_(src, non_blocking=True); b.record(); b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    out[name] = n / best
print(json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"e2e: measuring the link failed: {done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_child(script: str, site: str, model: str, env_extra: dict[str, str], timeout: float) -> tuple[list[dict[str, Any]], str, int]:
    env = dict(os.environ)
    env.pop("GPU_PAGER_DROP_IN", None)
    env.update(env_extra)
    paths = [site] + ([os.path.join(HERE, "e2e_hook")] if env.get("E2E_HOOK_MODE") else [])
    env["PYTHONPATH"] = ":".join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    env["PYTHONUNBUFFERED"] = "1"
    try:
        done = subprocess.run(
            [sys.executable, os.path.join(HERE, script), model],
            capture_output=True, text=True, timeout=timeout, env=env,
        )
        out, err, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        err += f"\ntimed out after {timeout:.0f} s"
        rc = -1
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows, err, rc


def cause(err: str) -> str:
    """The line of a dead engine's stderr that says why (a CUDA error first)."""
    lines = [line.strip() for line in err.splitlines() if line.strip()]
    for needle in ("illegal memory access", "CUDA error", "Error", "error"):
        hit = next((line for line in reversed(lines) if needle in line), None)
        if hit:
            return hit[:300]
    return lines[-1][:300] if lines else "(nothing on stderr)"


def compare(engine: str, runs: dict[str, list[dict[str, Any]]], links: dict[str, float]) -> list[dict[str, Any]]:
    """The checks across runs: each drop-in run against stock."""
    rows: list[dict[str, Any]] = []
    stock = runs.get("stock")
    if not stock:
        return rows

    def calls(rs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {r["check"]: r for r in rs if r.get("kind") == "call"}

    def tokens(rs: list[dict[str, Any]]) -> Any:
        return next((r["tokens"] for r in rs if r.get("check") == "reference"), None)

    weights_bytes = next((r["bytes"] for r in stock if r.get("check") == "weights-bytes"), 0)
    for name, rs in runs.items():
        if name == "stock" or not rs:
            continue

        def row(check: str, ok: bool, detail: str) -> None:
            rows.append({"engine": engine, "run": name, "check": check, "ok": ok, "detail": detail})

        ours_tokens, stock_tokens = tokens(rs), tokens(stock)
        row("tokens = stock's", ours_tokens is not None and ours_tokens == stock_tokens,
            "the reference batch's greedy tokens, token for token")
        ours, theirs = calls(rs), calls(stock)
        for call, r in ours.items():
            s = theirs.get(call)
            if s is None:
                continue
            if "freed" in r:
                row(f"{call}: freed >= stock", r["freed"] >= s["freed"] - (64 << 20),
                    f"{r['freed'] / GIB:.2f} GiB against {s['freed'] / GIB:.2f} GiB (NVML)")
            if any(w in call for w in ("sleep", "wake", "release")):
                row(f"{call}: time <= stock", r["seconds"] <= s["seconds"] * 1.02 + 0.005,
                    f"{r['seconds'] * 1e3:.1f} ms against {s['seconds'] * 1e3:.1f} ms")
        wake = ours.get("wake weights")
        if wake and weights_bytes and links.get("h2d"):
            ratio = wake["seconds"] / (weights_bytes / links["h2d"])
            row("wake weights <= 1.10x link", ratio <= LINK_LIMIT,
                f"{ratio:.2f}x the pinned H2D link ({weights_bytes / GIB:.2f} GiB at "
                f"{links['h2d'] / 1e9:.1f} GB/s: {weights_bytes / links['h2d'] * 1e3:.1f} ms)")
    return rows


def table(engine: str, runs: dict[str, list[dict[str, Any]]], links: dict[str, float]) -> None:
    """The calls of every run side by side: time (and x link for the weights), memory freed."""
    names = list(runs)
    order = list(dict.fromkeys(r["check"] for rs in runs.values() for r in rs if r.get("kind") == "call"))
    weights_bytes = next((r["bytes"] for rs in runs.values() for r in rs if r.get("check") == "weights-bytes"), 0)
    print(f"\n{engine}: time per call in ms (memory freed by a sleep, GiB)")
    print("| call | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for call in order:
        cells = []
        for n in names:
            r = next((r for r in runs[n] if r.get("check") == call and r.get("kind") == "call"), None)
            if r is None:
                cells.append("-")
                continue
            cell = f"{r['seconds'] * 1e3:.1f}"
            if "freed" in r:
                cell += f" ({r['freed'] / GIB:.2f})"
            if call == "wake weights" and weights_bytes and links.get("h2d"):
                cell += f" = {r['seconds'] / (weights_bytes / links['h2d']):.2f}x link"
            cells.append(cell)
        print(f"| {call} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packed")
    ap.add_argument("--only", nargs="*", default=None, help="engine names (vllm, sglang)")
    ap.add_argument("--runs", nargs="*", default=None, help="run names (stock, drop-in, ...)")
    ap.add_argument("--work", default="/tmp/e2e")
    ap.add_argument("--model-gib", type=float, default=5.4)
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--out", default=None, help="a file for the JSON rows")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    model = os.path.join(args.work, "model")
    build_model(model, args.model_gib)
    links = link(int(args.model_gib * GIB))
    log(f"pinned link: H2D {links['h2d'] / 1e9:.1f} GB/s, D2H {links['d2h'] / 1e9:.1f} GB/s")
    rows: list[dict[str, Any]] = []

    def keep(new: list[dict[str, Any]]) -> None:
        rows.extend(new)
        if args.out:
            with open(args.out, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in new)

    for engine, (script, variants) in RUNS.items():
        if args.only and not any(o in engine for o in args.only):
            continue
        archive = os.path.join(args.packed, f"{engine}.tar.xz")
        if not os.path.exists(archive):
            keep([{"engine": engine, "run": "-", "check": "packed", "ok": False,
                   "detail": f"no {archive}: run scripts/engine-pack"}])
            continue
        site = unpack(archive, args.work)
        runs: dict[str, list[dict[str, Any]]] = {}
        for name, env in variants:
            if args.runs and name not in args.runs:
                continue
            t = time.perf_counter()
            log(f"{engine} {name} ...")
            got, err, rc = run_child(script, site, model, env, args.timeout)
            for r in got:
                r.update(engine=engine, run=name)
            if rc != 0 and any(r["check"] == "skipped stage: started" for r in got) and not any(
                r["check"] == "skipped stage" for r in got
            ):
                got.append({"engine": engine, "run": name, "check": "skipped stage", "kind": "finding",
                            "ok": True, "detail": f"the engine's processes died (exit {rc}): {cause(err)}"})
                rc = 0
            if rc != 0 or not got or not all(r["ok"] for r in got):
                sys.stderr.write(err[-6000:] + "\n")
                if rc != 0:
                    got.append({"engine": engine, "run": name, "check": "process", "ok": False,
                                "detail": f"exit {rc}: {err.strip().splitlines()[-1:]}"})
            runs[name] = got
            keep(got)
            log(f"{engine} {name}: {sum(r['ok'] for r in got)}/{len(got)} in {time.perf_counter() - t:.0f} s")
        keep(compare(engine, runs, links))
        table(engine, runs, links)
    print()
    for r in rows:
        if r.get("kind") != "info":
            print(f"{'PASS' if r['ok'] else 'FAIL'} {r['engine']} {r['run']} {r['check']}: {r.get('detail', '')}")
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    raise SystemExit(1 if failed or not rows else 0)


if __name__ == "__main__":
    main()
