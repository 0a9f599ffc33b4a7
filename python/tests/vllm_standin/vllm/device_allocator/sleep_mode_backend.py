"""Stand-in for ``vllm.device_allocator.sleep_mode_backend``: the backend interface and a
registry of backends by name, loaded lazily by module path and class name."""

import importlib
from abc import ABC, abstractmethod
from typing import Callable, Collection


class SleepModeBackend(ABC):
    def __init__(self) -> None:
        self._state = "RUNNING"

    @abstractmethod
    def suspend(self, discardable: "Collection[int]" = ()) -> None: ...

    @abstractmethod
    def resume(self, tags: "list[str] | None" = None) -> None: ...

    def state(self) -> str:
        return self._state

    def discard(self, tags: "tuple[str, ...]") -> None:
        raise RuntimeError(
            f"Sleep-mode backend {type(self).__name__!r} does not support selective discard."
        )

    @classmethod
    def preserves_communicators(cls) -> bool:
        return False


class SleepModeBackendFactory:
    _registry: "dict[str, Callable[[], type[SleepModeBackend]]]" = {}

    @classmethod
    def register_backend(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"Sleep-mode backend '{name}' is already registered.")
        cls._registry[name] = lambda: getattr(importlib.import_module(module_path), class_name)

    @classmethod
    def get_backend_class(cls, name: str) -> "type[SleepModeBackend]":
        return cls._registry[name]()
