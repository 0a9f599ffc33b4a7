"""scripts/engine-pack's own logic, on the host: the fatbin trim keeps exactly what an sm_90
GPU loads and zeroes the rest in place, and a stub raises ImportError when used."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "engine-pack"


def engine_pack() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("engine_pack", str(SCRIPT))
    spec = importlib.util.spec_from_loader("engine_pack", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_pack"] = module  # its dataclasses look their module up
    loader.exec_module(module)
    return module


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", header, 28, arch)
    return bytes(header) + payload


def fatbin(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def elf(section: bytes) -> bytes:
    """An ELF64 file with two sections, .shstrtab and .nv_fatbin (``section``)."""
    names = b"\0.shstrtab\0.nv_fatbin\0"
    strtab_off = 64
    fat_off = strtab_off + len(names)
    fat_off += -fat_off % 8
    shoff = fat_off + len(section)
    shoff += -shoff % 8
    out = bytearray(shoff + 3 * 64)
    out[:4] = b"\x7fELF"
    struct.pack_into("<Q", out, 0x28, shoff)
    struct.pack_into("<HHH", out, 0x3A, 64, 3, 1)
    out[strtab_off : strtab_off + len(names)] = names
    out[fat_off : fat_off + len(section)] = section
    struct.pack_into("<IIQQQQIIQQ", out, shoff + 64, 1, 3, 0, 0, strtab_off, len(names), 0, 0, 1, 0)
    struct.pack_into("<IIQQQQIIQQ", out, shoff + 128, 11, 1, 0, 0, fat_off, len(section), 0, 0, 8, 0)
    return bytes(out)


def test_the_trim_keeps_what_sm90_loads_and_zeroes_the_rest(tmp_path: Path) -> None:
    ep = engine_pack()
    sass80, sass90, ptx80, ptx90 = b"\x80" * 40, b"\x90" * 24, b"P" * 16, b"Q" * 8
    ptx_only_70, ptx_only_80, sass_100 = b"7" * 16, b"8" * 16, b"X" * 32
    section = (
        fatbin(entry(2, 80, sass80), entry(2, 90, sass90), entry(1, 80, ptx80), entry(1, 90, ptx90))
        + bytes(8)  # padding between fatbins
        + fatbin(entry(1, 70, ptx_only_70), entry(1, 80, ptx_only_80), entry(2, 100, sass_100))
    )
    lib = tmp_path / "lib.so"
    original = elf(section)
    lib.write_bytes(original)
    zeroed, kept = ep.trim_fatbins(lib)
    data = lib.read_bytes()
    assert len(data) == len(original)
    # Fatbin 1 has SASS for sm_90: only that stays. Fatbin 2 has none: its newest PTX <= 90.
    assert sass90 in data and ptx_only_80 in data
    for gone in (sass80, ptx80, ptx90, ptx_only_70, sass_100):
        assert gone not in data
    assert kept == len(sass90) + len(ptx_only_80)
    assert zeroed == sum(map(len, (sass80, ptx80, ptx90, ptx_only_70, sass_100)))
    # Nothing outside the payloads moved: headers and the rest of the file are as they were.
    changed = [i for i, (a, b) in enumerate(zip(original, data)) if a != b]
    assert len(changed) == zeroed


def test_a_stub_imports_and_raises_when_used(tmp_path: Path) -> None:
    ep = engine_pack()
    ep.write_stub(tmp_path, "notthere_grammar", "not packed for this run")
    code = (
        "import notthere_grammar as g\n"
        "Matcher = g.GrammarMatcher\n"  # an annotation's attribute: fine
        "def f(m: g.CompiledGrammar) -> None: ...\n"
        "try:\n"
        "    Matcher()\n"
        "except ImportError as e:\n"
        "    print('raised:', e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert "raised: notthere_grammar is a stub of gpu-pager's scripts/engine-pack" in done.stdout
    assert "not packed for this run" in done.stdout


@pytest.mark.parametrize("name", ["vllm-0.24.0", "sglang-0.5.12"])
def test_every_engine_names_pinned_dependencies(name: str) -> None:
    ep = engine_pack()
    engine = next(e for e in ep.ENGINES if f"{e.name}-{e.version}" == name)
    assert all(d.count("==") == 1 for d in engine.deps), engine.deps
    names = [d.split("==")[0].lower().replace("_", "-") for d in engine.deps]
    assert len(names) == len(set(names)), "a dependency named twice"
