"""The vLLM drop-in without a GPU: the ``MemAllocator`` surface and its refusals, and the
``vllm.general_plugins`` entry point against a stand-in package with vLLM's module paths
(``tests/vllm_standin``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpu_pager.compat import vllm as drop_in
from fresh import run_python

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_standin")


def run(code: str, standin: str = STANDIN, **env: str) -> subprocess.CompletedProcess[str]:
    """``run_python`` with the stand-in vLLM importable."""
    path = standin + os.pathsep + os.environ.get("PYTHONPATH", "")
    return run_python(code, PYTHONPATH=path, **env)


def moved_standin(root: Path, shims: bool) -> str:
    """The stand-in in the layout of vLLM's main branch: the allocator package under
    ``vllm.backends.platform`` and, with ``shims``, vLLM's compatibility shims at the old
    path (the package forwards attribute reads, its modules are aliases in
    ``sys.modules``)."""
    shutil.copytree(
        os.path.join(STANDIN, "vllm"), root / "vllm", ignore=shutil.ignore_patterns("__pycache__")
    )
    old, new = "vllm.device_allocator", "vllm.backends.platform.device_allocator"
    old_dir, new_dir = root / "vllm" / "device_allocator", root.joinpath(*new.split("."))
    new_dir.parent.mkdir(parents=True)
    for package in (new_dir.parent.parent, new_dir.parent):
        (package / "__init__.py").write_text("")
    old_dir.rename(new_dir)
    for module in new_dir.glob("*.py"):
        module.write_text(module.read_text().replace(old, new))
    if shims:
        old_dir.mkdir()
        (old_dir / "__init__.py").write_text(
            f"import importlib\n_real = importlib.import_module({new!r})\n"
            "def __getattr__(name):\n    return getattr(_real, name)\n"
        )
        for name in ("cumem", "sleep_mode_backend"):
            real = f"{new}.{name}"
            (old_dir / f"{name}.py").write_text(
                f"import importlib, sys\nsys.modules[__name__] = importlib.import_module({real!r})\n"
            )
    return str(root)


def test_the_protocol_surface_and_its_refusals() -> None:
    a = drop_in.get_mem_allocator_instance()
    assert a is drop_in.CuMemAllocator.get_instance()
    assert drop_in.DEFERRABLE_TAGS == ("weights", "kv_cache")
    assert a.get_current_usage() == 0 and a.pointer_to_data == {}
    a.sleep()  # nothing allocated: nothing to do
    a.wake_up()
    # vLLM ignores tags without allocations (a KV-only worker, a wake before weights exist).
    a.wake_up(["weights"])
    a.discard("kv_cache")
    assert a.get_current_usage() == 0 and a.pointer_to_data == {}
    with pytest.raises(ValueError, match="does not exist"):
        with a.reuse_memory_pool("weights"):
            pass
    a.release_pools()
    a.close()


def test_the_entry_point_switches_vllm_only_when_asked() -> None:
    """vLLM's plugin loader finds gpu_pager's entry point (installed with the wheel); the
    sleep-mode backend is registered either way, the allocator swapped only on request.
    The backend without the allocator's switch refuses to start (the model's memory would
    be vLLM's, which it cannot free) instead of sleeping nothing."""
    code = """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.device_allocator import get_mem_allocator_instance
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackend, SleepModeBackendFactory
        import vllm.device_allocator.cumem as cumem
        print(type(get_mem_allocator_instance()).__module__, cumem.CuMemAllocator.__module__)
        backend = SleepModeBackendFactory.get_backend_class("gpu_pager")
        assert issubclass(backend, SleepModeBackend)
        b = backend()
        b.suspend(set())  # nothing allocated: a no-op sleep of gpu_pager's allocator
        b.resume(None)
        assert b.state() == "RUNNING" and backend.preserves_communicators()
    """
    off = run(code, GPU_PAGER_DROP_IN="")
    assert off.returncode != 0
    assert off.stdout.split() == ["vllm.device_allocator.cumem"] * 2
    assert "--sleep-mode-backend gpu_pager needs gpu_pager's allocator" in off.stderr
    assert "set GPU_PAGER_DROP_IN=vllm" in off.stderr
    on = run(code, GPU_PAGER_DROP_IN="vllm")
    assert on.returncode == 0, on.stderr
    assert on.stdout.split() == ["gpu_pager.compat.vllm"] * 2


def test_a_vllm_plugins_list_without_gpu_pager_is_reported_at_start() -> None:
    """vLLM loads only the plugins ``VLLM_PLUGINS`` names: one that leaves gpu_pager out
    would keep vLLM's own allocator without a word, so every process says so on stderr."""
    code = """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.device_allocator import get_mem_allocator_instance
        print(type(get_mem_allocator_instance()).__module__)
    """
    left_out = run(code, GPU_PAGER_DROP_IN="vllm", VLLM_PLUGINS="lora_resolver")
    assert left_out.returncode == 0, left_out.stderr
    assert left_out.stdout.strip() == "vllm.device_allocator.cumem"
    assert (
        "gpu_pager: GPU_PAGER_DROP_IN names vllm, but VLLM_PLUGINS='lora_resolver' does not "
        "name gpu_pager, so vLLM keeps its own allocator: add gpu_pager to VLLM_PLUGINS"
    ) in left_out.stderr
    named = run(code, GPU_PAGER_DROP_IN="vllm", VLLM_PLUGINS="lora_resolver,gpu_pager")
    assert named.returncode == 0, named.stderr
    assert named.stdout.strip() == "gpu_pager.compat.vllm"
    assert "VLLM_PLUGINS" not in named.stderr
    other = run(code, GPU_PAGER_DROP_IN="torch_memory_saver", VLLM_PLUGINS="lora_resolver")
    assert "VLLM_PLUGINS" not in other.stderr


def test_the_entry_point_without_vllm_s_registry_still_switches(tmp_path: Path) -> None:
    """vLLM 0.24 has no sleep-mode backends: the entry point switches the allocator alone."""
    code = """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.device_allocator import get_mem_allocator_instance
        print(type(get_mem_allocator_instance()).__module__)
    """
    done = run(code, release_standin(tmp_path, "0.24.0", "0.24"), GPU_PAGER_DROP_IN="all")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gpu_pager.compat.vllm"


@pytest.mark.parametrize("shims", [True, False], ids=["with-old-path-shims", "new-path-only"])
def test_the_entry_point_switches_vllm_in_its_new_layout(tmp_path: Path, shims: bool) -> None:
    """vLLM's main branch keeps the allocator under ``vllm.backends.platform``, and its
    worker binds ``get_mem_allocator_instance`` at import, before the plugins run: that
    function, the backend registry and the tag hooks are all gpu_pager's, with or without
    the old path's shims."""
    code = """
        from vllm.backends.platform.device_allocator import get_mem_allocator_instance
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import vllm.backends.platform.device_allocator.cumem as cumem
        from vllm.backends.platform.device_allocator.sleep_mode_backend import SleepModeBackendFactory
        from gpu_pager.compat.vllm import _vllm_tag_hooks
        b = SleepModeBackendFactory.get_backend_class("gpu_pager")()
        b.suspend(set())
        b.resume(None)
        print(type(get_mem_allocator_instance()).__module__, cumem.CuMemAllocator.__module__)
        print("hooks", _vllm_tag_hooks() is not None)
        try:
            import vllm.device_allocator as old
        except ImportError:
            print("no old path")
        else:
            print("old path", type(old.get_mem_allocator_instance()).__module__)
    """
    done = run(code, moved_standin(tmp_path, shims), GPU_PAGER_DROP_IN="vllm")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "gpu_pager.compat.vllm gpu_pager.compat.vllm",
        "hooks True",
        "old path gpu_pager.compat.vllm" if shims else "no old path",
    ]


def test_the_entry_point_without_vllm_s_allocator_says_so(tmp_path: Path) -> None:
    """Asked to switch a vLLM that has the allocator in neither place, the entry point fails
    with what to do instead of leaving vLLM's own allocator in place unnoticed."""
    root = Path(moved_standin(tmp_path, shims=False))
    shutil.rmtree(root / "vllm" / "backends")
    code = """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
    """
    done = run(code, str(root), GPU_PAGER_DROP_IN="vllm")
    assert done.returncode != 0
    assert "this vLLM has neither vllm.backends.platform.device_allocator" in done.stderr
    assert "unset GPU_PAGER_DROP_IN" in done.stderr
    assert run(code, str(root), GPU_PAGER_DROP_IN="").returncode == 0


def test_the_backend_discards_through_the_allocator() -> None:
    """vLLM's ``release_kv_cache_memory`` calls the backend's ``discard``, which vLLM's base
    class refuses: gpu_pager's backend hands it to the allocator (which, as vLLM's, ignores
    a tag without allocations)."""
    code = """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
        from gpu_pager.compat import vllm as drop_in
        calls = []
        original = drop_in.CuMemAllocator.discard
        def discard(self, tags):
            calls.append(tuple(tags))
            original(self, tags)
        drop_in.CuMemAllocator.discard = discard
        b = SleepModeBackendFactory.get_backend_class("gpu_pager")()
        b.discard(("kv_cache",))
        print("allocator:", calls)
    """
    done = run(code, GPU_PAGER_DROP_IN="vllm")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("allocator: [('kv_cache',)]"), done.stdout


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), ("YES", True), ("0", False), ("", False), ("false", False)],
)
def test_release_host_memory_follows_vllm_s_variable(
    monkeypatch: pytest.MonkeyPatch, value: str, on: bool
) -> None:
    monkeypatch.setenv(drop_in.RELEASE_HOST_MEMORY_ENV, value)
    assert drop_in.release_host_memory() is on


# The allocator over a recording stand-in for gpu_pager.torch (no torch here) that moves
# real regions of the host pager (so the tags' companions, vLLM's hooks, run as they do on a
# GPU): `log` gets each release (with the tags it drops) and resume, in order.
RECORDED = """
    import sys, types
    sys.modules["torch"] = types.SimpleNamespace(
        cuda=types.SimpleNamespace(empty_cache=lambda: None))
    import gpu_pager
    import vllm.device_allocator as va
    from gpu_pager.compat import vllm as drop_in
    log = []
    real = gpu_pager.Pager.for_device(0)

    class Pager:
        fail = False
        def pager(self, device):
            return real
        def release(self, tags, device, drop, meanwhile=None):
            if self.fail:
                raise RuntimeError("release failed")
            real.release(tags, drop or None)
            if meanwhile is not None:
                meanwhile()
            log.append(("release", *tags) + (("drop", *drop) if drop else ()))
        def resume(self, tags, device):
            log.append(("resume", *tags))
            real.resume(tags)

    pager = Pager()
    drop_in._gpt = lambda: pager

    def allocator(*tags):
        a = drop_in.CuMemAllocator()
        a._device = 0
        for t in tags:
            real.region(t, "preserve", 1 << 20)
            a._add_tag(t)
        return a

    def step(name, call):
        log.clear()
        call()
        print(name, log)
"""


def run_recorded(code: str) -> list[str]:
    """Runs ``RECORDED`` + ``code`` with the stand-in vLLM; the lines it printed."""
    done = run(RECORDED + code)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_vllm_s_tag_hooks_run_around_unmapping_and_mapping() -> None:
    """Where vLLM has tag hooks (a KV connector's transport registration), a tag's
    before-unmap hooks run before its memory is unmapped and its after-map hooks after it is
    mapped back, as the pager's companions of the tag; a release that fails before them
    runs none."""
    code = """
    for tag in ("kv_cache", "weights"):
        va.register_tag_hooks(
            tag, lambda t=tag: log.append(("before", t)), lambda t=tag: log.append(("after", t)))
    a = allocator("weights", "kv_cache")
    step("discard", lambda: a.discard("kv_cache"))
    step("sleep", lambda: a.sleep(("weights",)))
    step("wake weights", lambda: a.wake_up(["weights"]))
    step("wake all", lambda: a.wake_up())
    pager.fail = True
    try:
        step("failed sleep", lambda: a.sleep())
    except RuntimeError:
        print("failed sleep", log, a._kept)
    """
    printed = run_recorded(code)
    assert printed == [
        "discard [('before', 'kv_cache'), ('release', 'kv_cache', 'drop', 'kv_cache')]",
        "sleep [('before', 'weights'), ('release', 'weights')]",
        "wake weights [('resume', 'weights'), ('after', 'weights')]",
        "wake all [('resume', 'kv_cache'), ('after', 'kv_cache')]",
        "failed sleep [] {}",
    ]


def test_without_vllm_s_tag_hooks_the_tags_have_no_companion() -> None:
    """A vLLM without tag hooks (every release up to 0.34) gives the tags' regions no
    companion, so that a release never waits for the GIL that the collection beside it
    holds; sleep and wake-up work as before. With hooks, each tag has one."""
    code = """
    added = []
    class Counting:
        def add_companion(self, tag, *rest):
            added.append(tag)
            return real.add_companion(tag, *rest)
        def __getattr__(self, name):
            return getattr(real, name)
    pager.pager = lambda device: Counting()
    hooks = (va.run_before_unmap_hooks, va.run_after_map_hooks)
    del va.run_before_unmap_hooks, va.run_after_map_hooks
    a = allocator("weights", "kv_cache")
    print("without", added)
    step("sleep", lambda: a.sleep(("weights",)))
    step("wake", lambda: a.wake_up())
    va.run_before_unmap_hooks, va.run_after_map_hooks = hooks
    allocator("draft")
    print("with", added)
    """
    printed = run_recorded(code)
    assert printed == [
        "without []",
        "sleep [('release', 'weights', 'kv_cache', 'drop', 'kv_cache')]",
        "wake [('resume', 'weights', 'kv_cache')]",
        "with ['draft']",
    ]


def test_a_raising_vllm_hook_undoes_the_sleep_and_the_wake_up() -> None:
    """A hook that raises (a transport that cannot deregister) fails the sleep with
    ``CompanionError`` and leaves every tag awake, the hooks that ran undone; at a wake-up
    it leaves every tag asleep, and the next wake-up, once the hook works, maps them."""
    code = """
    broken = {"before": False, "after": False}
    def hook(kind, tag):
        if broken[kind] and tag == "weights":
            raise ConnectionError(f"{kind} hook of {tag} failed")
        log.append((kind, tag))
    for tag in ("kv_cache", "weights"):
        va.register_tag_hooks(
            tag, lambda t=tag: hook("before", t), lambda t=tag: hook("after", t))
    a = allocator("kv_cache", "weights")
    broken["before"] = True
    try:
        step("sleep", lambda: a.sleep())
    except gpu_pager.CompanionError as e:
        print("sleep failed", log, a._kept, [real.info(t).state.value for t in a._tags])
        assert "ConnectionError: before hook of weights failed" in str(e), e
    broken["before"] = False
    step("sleep", lambda: a.sleep())
    broken["after"] = True
    try:
        step("wake", lambda: a.wake_up())
    except gpu_pager.CompanionError:
        print("wake failed", log, [real.info(t).state.value for t in a._tags])
    broken["after"] = False
    step("wake", lambda: a.wake_up())
    """
    printed = run_recorded(code)
    assert printed == [
        "sleep failed [('before', 'kv_cache'), ('after', 'kv_cache')] {} "
        "['resident', 'resident']",
        "sleep [('before', 'kv_cache'), ('before', 'weights'), "
        "('release', 'kv_cache', 'weights', 'drop', 'kv_cache', 'weights')]",
        "wake failed [('resume', 'kv_cache', 'weights'), ('after', 'kv_cache'), "
        "('before', 'kv_cache')] ['released', 'released']",
        "wake [('resume', 'kv_cache', 'weights'), ('after', 'kv_cache'), ('after', 'weights')]",
    ]


def test_runtime_state_and_graphs_are_kept_at_every_sleep_level() -> None:
    """vLLM's runtime state (block tables) and the graphs' pool survive both levels:
    level 2 keeps nothing else, level 1 the weights too; an explicit discard still drops
    them."""
    code = """
    a = allocator("weights", "runtime", "cuda_graph", "kv_cache")
    step("level 2", lambda: a.sleep(offload_tags=()))
    a.wake_up()
    step("level 1", lambda: a.sleep(offload_tags=("weights",)))
    a.wake_up()
    step("discard", lambda: a.discard("runtime"))
    """
    printed = run_recorded(code)
    every = "'weights', 'runtime', 'cuda_graph', 'kv_cache'"
    assert printed == [
        f"level 2 [('release', {every}, 'drop', 'weights', 'kv_cache')]",
        f"level 1 [('release', {every}, 'drop', 'kv_cache')]",
        "discard [('release', 'runtime', 'drop', 'runtime')]",
    ]


def release_standin(root: Path, version: str, protocol: str) -> str:
    """The stand-in as vLLM ``version`` with the signatures of ``protocol``'s releases:
    ``"0.24"`` (no backends, ``sleep(offload_tags)``, no ``DEFERRABLE_TAGS``), ``"0.31"``
    (``suspend(level)``), ``"0.33"`` (``suspend(level)``, ``DEFERRABLE_TAGS``) or
    ``"0.34"`` (``suspend(discardable)``, ``sleep(offload_tags, discardable)``)."""
    shutil.copytree(
        os.path.join(STANDIN, "vllm"), root / "vllm", ignore=shutil.ignore_patterns("__pycache__")
    )
    init = root / "vllm" / "__init__.py"
    init.write_text(init.read_text().replace('"0.34.0"', repr(version)))
    allocators = root / "vllm" / "device_allocator" / "__init__.py"
    backends = root / "vllm" / "device_allocator" / "sleep_mode_backend.py"
    text = allocators.read_text()
    if protocol != "0.34":
        text = text.replace(", discardable: Collection[int] = ()", "")
        backends.write_text(
            backends.read_text().replace(
                'def suspend(self, discardable: "Collection[int]" = ())', "def suspend(self, level: int = 1)"
            )
        )
    if protocol in ("0.24", "0.31"):
        text = text.replace('DEFERRABLE_TAGS: tuple[str, ...] = ("weights", "kv_cache")', "")
    allocators.write_text(text)
    if protocol == "0.24":
        backends.unlink()
    return str(root)


@pytest.mark.parametrize(
    ("version", "protocol"),
    [("0.24.0", "0.24"), ("0.29.0", "0.31"), ("0.31.1", "0.31"), ("0.33.0", "0.33"), ("0.34.0", "0.34")],
)
def test_each_supported_release_is_switched(tmp_path: Path, version: str, protocol: str) -> None:
    code = """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.device_allocator import get_mem_allocator_instance
        from gpu_pager.compat.vllm import _protocol
        print(type(get_mem_allocator_instance()).__module__, _protocol().releases)
    """
    done = run(code, release_standin(tmp_path, version, protocol), GPU_PAGER_DROP_IN="vllm")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "gpu_pager.compat.vllm"
    assert protocol in done.stdout


@pytest.mark.parametrize(
    ("version", "protocol", "why"),
    [
        ("0.35.0", "0.34", "knows the sleep protocols of vLLM 0.24, 0.29, 0.31, 0.33, 0.34, not vLLM 0.35.0's"),
        ("0.30.0", "0.31", "not vLLM 0.30.0's"),
        ("0.34.0", "0.33", "SleepModeBackend.suspend takes: level (vLLM 0.34: discardable)"),
        ("0.33.0", "0.34", "MemAllocator.sleep takes discardable: True (vLLM 0.33: False)"),
        ("0.31.0", "0.33", "DEFERRABLE_TAGS exists: True (vLLM 0.29, 0.31: False)"),
    ],
)
def test_an_unknown_release_or_protocol_is_refused(
    tmp_path: Path, version: str, protocol: str, why: str
) -> None:
    """A vLLM whose release the drop-in does not know, or whose signatures are not those of
    its release, is refused at the entry point (vLLM's start fails with the reason and the
    supported releases) instead of being answered in another release's semantics; without
    the switch it starts, on its own allocator; the backend refuses to start either way."""
    root = release_standin(tmp_path, version, protocol)
    code = """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
    """
    refused = run(code, root, GPU_PAGER_DROP_IN="vllm")
    assert refused.returncode != 0
    assert why in refused.stderr, refused.stderr
    assert "unset GPU_PAGER_DROP_IN to keep vLLM's own allocator" in refused.stderr
    backend = run(
        code + """
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
        SleepModeBackendFactory.get_backend_class("gpu_pager")()
        """,
        root,
        GPU_PAGER_DROP_IN="",
    )
    assert backend.returncode != 0
    assert "--sleep-mode-backend gpu_pager: " in backend.stderr and why in backend.stderr


@pytest.mark.parametrize(
    ("version", "protocol", "calls", "slept"),
    [
        ("0.34.0", "0.34", "b.suspend(set())", "kept weights"),
        ("0.34.0", "0.34", "b.suspend({1, 2})", "kept weights"),
        ("0.34.0", "0.34", "b.suspend(1)", "TypeError"),
        ("0.33.0", "0.33", "b.suspend(1)", "kept weights"),
        ("0.33.0", "0.33", "b.suspend(level=2)", "dropped weights"),
        ("0.31.0", "0.31", "b.suspend(2)", "dropped weights"),
        ("0.31.0", "0.31", "b.suspend(set())", "TypeError"),
    ],
)
def test_the_backend_sleeps_in_its_release_s_protocol(
    tmp_path: Path, version: str, protocol: str, calls: str, slept: str
) -> None:
    """vLLM 0.34's worker calls ``suspend(discardable)``, 0.29 to 0.33 ``suspend(level)``: the
    backend keeps the weights at level 1 and for any ``discardable`` (an earlier one read
    ``set()`` as level 2 and dropped them), and refuses an argument of the other protocol."""
    code = RECORDED + f"""
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    a = allocator("weights", "kv_cache")
    drop_in.CuMemAllocator.instance = a
    b = SleepModeBackendFactory.get_backend_class("gpu_pager")()
    try:
        {calls}
    except TypeError as e:
        print("TypeError", e)
    else:
        print("kept weights" if a._kept["weights"] else "dropped weights", log)
    """
    done = run(code, release_standin(tmp_path, version, protocol), GPU_PAGER_DROP_IN="vllm")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(slept), done.stdout


@pytest.mark.parametrize(("version", "protocol", "woke"), [
    ("0.31.0", "0.31", "['weights']"),
    ("0.33.0", "0.33", "['weights', 'runtime', 'default']"),
])
def test_a_selective_wake_up_follows_its_release(
    tmp_path: Path, version: str, protocol: str, woke: str
) -> None:
    """Up to vLLM 0.31 ``wake_up(["weights"])`` wakes the weights alone; from 0.33 on it also
    wakes every tag that is not deferrable (block tables, vLLM's default tag)."""
    code = RECORDED + """
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    a = allocator("weights", "runtime", "default", "kv_cache")
    a.sleep(("weights",))
    log.clear()
    a.wake_up(["weights"])
    print(list(log[0][1:]))
    """
    done = run(code, release_standin(tmp_path, version, protocol), GPU_PAGER_DROP_IN="vllm")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == woke


def test_sleep_and_wake_up_from_several_threads_keep_the_books() -> None:
    """RL frameworks call vLLM's allocator from their own threads: sleeps and wake-ups on 4
    threads at once raise nothing, and every tag ends awake with nothing left asleep (review
    item 9: the books raced, 80 ``KeyError``s in 4 threads x 150 calls)."""
    code = """
    import threading, time
    a = allocator("weights", "kv_cache")
    slow = pager.release
    def release(*args, **kwargs):
        time.sleep(0.0005)  # widens the window between the move and the books
        return slow(*args, **kwargs)
    pager.release = release
    errors = []
    def worker(k):
        for i in range(150):
            try:
                if (i + k) % 2:
                    a.sleep(offload_tags=("weights",))
                else:
                    a.wake_up()
            except Exception as e:
                errors.append(type(e).__name__)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a.wake_up()
    print("errors", len(errors), sorted(set(errors)))
    print("asleep", a._kept)
    print("regions", sorted((r.tag, r.released_bytes) for r in real.stats().regions))
    """
    printed = run_recorded(code)
    assert printed == [
        "errors 0 []",
        "asleep {}",
        "regions [('kv_cache', 0), ('weights', 0)]",
    ]
