"""Every engine release's own sleep code against gpu_pager's drop-ins, on the GPU: a process
per release and switch (``vllm_checks.py``, ``sglang_checks.py``), then a table of release x
switch x check. Exits non-zero when a check fails.

    python run.py ENGINES_DIR [--only SUBSTRING ...] [--out FILE]

ENGINES_DIR holds what scripts/engines-extract took from each release's wheel
(``.gpu/engines`` after scripts/gpu-pack). Switches: vLLM ``stock`` (the release's own
allocator, to show the checks read the release as it is), ``drop-in``
(``GPU_PAGER_DROP_IN=vllm``) and, from 0.29, ``backend`` (``--sleep-mode-backend
gpu_pager``); SGLang ``preload`` and ``torch`` (the two hook modes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import release as rel  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def runs(engines: str) -> list[tuple[str, str, str]]:
    """(script, release dir, switch) for every release found: gpu_pager's switches first,
    newest release first, then the releases' own allocators (``stock``)."""
    out = []
    for d in sorted(os.listdir(engines), key=lambda d: (d.split("-")[0], rel.version_numbers(os.path.join(engines, d)))):
        path = os.path.join(engines, d)
        if d.startswith("vllm-"):
            switches = ["stock", "drop-in"] + (["backend"] if rel.version_numbers(path) >= (0, 29) else [])
            out += [("vllm_checks.py", path, s) for s in switches]
        elif d.startswith("sglang-"):
            out += [("sglang_checks.py", path, s) for s in ("preload", "torch")]
    out.reverse()
    return sorted(out, key=lambda r: r[2] == "stock")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", default=None, help="a file for the JSON rows")
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    if args.out:
        open(args.out, "w").close()
    for script, path, switch in runs(args.engines):
        key = f"{os.path.basename(path)} {switch}"
        if args.only and not any(o in key for o in args.only):
            continue
        t = time.perf_counter()
        print(f"engines: {key} ...", file=sys.stderr, flush=True)
        try:
            done = subprocess.run(
                [sys.executable, os.path.join(HERE, script), path, switch],
                capture_output=True, text=True, timeout=args.timeout,
            )
            out, err, rc = done.stdout, done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, rc = f"timed out after {args.timeout:.0f} s", -1
        got = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        rows += got
        if args.out:  # as they come, so that a run cut short still leaves its rows
            with open(args.out, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in got)
        if rc != 0 or not got or not all(r["ok"] for r in got):
            sys.stderr.write(err[-4000:])
            if rc != 0:
                rows.append({"release": os.path.basename(path), "switch": switch, "check": "process",
                             "ok": False, "detail": f"exit {rc}: {err.strip().splitlines()[-1:] }"})
        print(f"engines: {key}: {sum(r['ok'] for r in got)}/{len(got)} in "
              f"{time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    table(rows)
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    raise SystemExit(1 if failed or not rows else 0)


def table(rows: list[dict[str, Any]]) -> None:
    """Release x switch x check, PASS or FAIL, and what each check measured."""
    checks = list(dict.fromkeys(r["check"] for r in rows))
    keys = list(dict.fromkeys((r["release"], r["switch"]) for r in rows))
    print("| release | switch | " + " | ".join(checks) + " |")
    print("|---|---|" + "---|" * len(checks))
    for release, switch in keys:
        cells = []
        for c in checks:
            r = next((r for r in rows if (r["release"], r["switch"], r["check"]) == (release, switch, c)), None)
            cells.append("-" if r is None else "PASS" if r["ok"] else "FAIL")
        print(f"| {release} | {switch} | " + " | ".join(cells) + " |")
    for r in rows:
        print(f"{'PASS' if r['ok'] else 'FAIL'} {r['release']} {r['switch']} {r['check']}: {r['detail']}")


if __name__ == "__main__":
    main()
