"""``gpu_pager.torch.audit()``: where a device's memory is in a torch process (the pager's
audit, torch's segments outside every tag, live allocations inside discard tags), and the
filter that adds torch's largest holders to the pager's warning after a release (from the
warning's data, the log record's ``gpu_pager`` fields)."""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

from gpu_pager._native import Audit, Pager, Policy
from gpu_pager._pools import device_index as _index
from gpu_pager._pools import load_torch as _torch


@dataclasses.dataclass(frozen=True)
class OutsideSegment:
    """A segment torch holds outside every tag: device memory the pager's releases leave
    where it is."""

    address: int
    """Its first device address."""
    bytes: int
    """Its size."""
    pool: tuple[int, int]
    """torch's id of its pool (``(0, 0)``: the default pool)."""
    site: str | None
    """Where its first live block was allocated (``file:line in function``), when torch
    records memory history (``torch.cuda.memory._record_memory_history()``), else ``None``."""


@dataclasses.dataclass(frozen=True)
class DiscardedAllocation:
    """A live tensor allocation inside a ``discard`` tag: its contents are dropped at every
    release. Anything here that is not KV cache (metadata that outlives the step it was made
    for) comes back as garbage, or as NaN with poisoned discards."""

    tag: str
    """The discard tag."""
    bytes: int
    """The block's size."""
    site: str | None
    """Where it was allocated, when torch records memory history, else ``None``."""


@dataclasses.dataclass(frozen=True)
class TorchAudit:
    """Where a device's memory is, in a torch process (``audit()``): the pager's audit
    (each tag, the device's use) and torch's segments outside every tag, largest first.
    ``str()`` is a table."""

    pager: Audit
    """The pager's audit: each region, the device's totals."""
    outside_tags: list[OutsideSegment]
    """torch's segments outside every region, largest first."""
    discarded: list[DiscardedAllocation] = dataclasses.field(default_factory=list)
    """The live allocations inside ``discard`` tags, by tag, largest first: the place to look
    for state that must survive a sleep but was allocated under a discarded tag."""

    @property
    def torch_outside_bytes(self) -> int:
        """Bytes torch holds outside every tag."""
        return sum(s.bytes for s in self.outside_tags)

    @property
    def other_bytes(self) -> int:
        """Device memory in use outside the tags and outside torch: the CUDA context,
        libraries and other allocators of this process, and other processes."""
        return max(0, self.pager.outside_bytes - self.torch_outside_bytes)

    def __str__(self) -> str:
        gib = 1 << 30
        lines = [str(self.pager), f"torch outside every tag: {self.torch_outside_bytes / gib:.2f} GiB "
                 f"in {len(self.outside_tags)} segments"]
        for seg in self.outside_tags[:8]:
            where = seg.site or "site unknown (torch.cuda.memory._record_memory_history())"
            lines.append(f"  {seg.bytes / gib:8.2f} GiB at {seg.address:#x}, pool {seg.pool}: {where}")
        lines.append(f"the rest (CUDA context, other allocators and processes): "
                     f"{self.other_bytes / gib:.2f} GiB")
        mine = self.pager.this_process_bytes
        if mine is not None:
            own_rest = max(0, mine - self.pager.mapped_bytes - self.torch_outside_bytes)
            lines.append(f"  of it in this process (CUDA context, libraries, other "
                         f"allocators): {own_rest / gib:.2f} GiB")
        if self.discarded:
            lines.append(f"live allocations in discard tags (dropped at every release): "
                         f"{len(self.discarded)}")
            for a in self.discarded[:8]:
                lines.append(f"  {a.tag}: {a.bytes} bytes, {a.site or 'site unknown'}")
        return "\n".join(lines)


def _live_blocks(segment: dict[str, Any]) -> list[dict[str, Any]]:
    """The segment's blocks in use."""
    return [b for b in segment.get("blocks", []) if str(b.get("state", "")).startswith("active")]


def _is_caller_frame(filename: str) -> bool:
    """A Python frame of the caller's: a ``.py`` file outside torch, or code without a file
    (``<string>``, ``<stdin>``); not torch's own frames, nor the C++ frames torch records
    with them."""
    if "/torch/" in filename:
        return False
    return filename.endswith(".py") or (filename.startswith("<") and filename.endswith(">"))


def _block_site(block: dict[str, Any]) -> str | None:
    """The block's first allocation frame in the caller's Python code, if torch recorded
    it."""
    for frame in block.get("frames", []) or []:
        filename = str(frame.get("filename", ""))
        if _is_caller_frame(filename):
            return f"{filename}:{frame.get('line')} in {frame.get('name')}"
    return None


def _site(segment: dict[str, Any]) -> str | None:
    """Where the segment's first live block was allocated, if recorded."""
    for block in _live_blocks(segment):
        site = _block_site(block)
        if site is not None:
            return site
    return None


def _scan(index: int, p: Pager) -> tuple[list[OutsideSegment], list[DiscardedAllocation]]:
    """torch's segments on device ``index`` outside every region of ``p`` (largest first),
    and the live allocations inside its ``discard`` regions (by tag, largest first)."""
    torch = _torch()
    spans = [
        (r.info.base, r.info.base + r.info.size, r.info.tag, r.info.policy)
        for r in p.stats().regions
    ]
    outside: list[OutsideSegment] = []
    discarded: list[DiscardedAllocation] = []
    for seg in torch.cuda.memory_snapshot():
        if int(seg.get("device", index)) != index:
            continue
        address, size = int(seg["address"]), int(seg["total_size"])
        region = next((sp for sp in spans if sp[0] <= address < sp[1]), None)
        if region is None:
            pool = seg.get("segment_pool_id", (0, 0))
            outside.append(
                OutsideSegment(address, size, (int(pool[0]), int(pool[1])), _site(seg))
            )
        elif region[3] != Policy.PRESERVE:
            discarded.extend(
                DiscardedAllocation(region[2], int(b.get("size", 0)), _block_site(b))
                for b in _live_blocks(seg)
            )
    outside.sort(key=lambda s: (-s.bytes, s.address))
    discarded.sort(key=lambda a: (a.tag, -a.bytes))
    return outside, discarded


def audit(device: Any = None) -> TorchAudit:
    """Where ``device``'s memory is (default: torch's current device): each tag's mapped,
    reserved and backed-up bytes and state, torch's segments outside every tag (with the
    allocation site when torch records memory history), the rest the driver reports in use,
    and the live allocations inside ``discard`` tags. After a ``release``, what is still on
    the GPU and who holds it; before one, what a discard would lose."""
    index = _index(device)
    p = Pager.for_device(index)
    report = p.audit()
    outside, discarded = _scan(index, p)
    return TorchAudit(report, outside, discarded)


# The ``event`` field of the core's warning of memory still in use after a release.
_RESIDENT_EVENT = "resident_after_release"


class _NameTorchHolders(logging.Filter):
    """Adds torch's largest segments outside every tag, with their allocation sites, to the
    pager's warning that much memory stays in use after a release: the pager sees only the
    bytes outside its regions; in a torch process, torch knows who holds them."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = getattr(record, "gpu_pager", None)
        if not isinstance(fields, dict) or fields.get("event") != _RESIDENT_EVENT:
            return True
        if _torch_if_imported() is None:
            return True
        index = int(fields["device"])
        try:
            outside, _ = _scan(index, Pager.for_device(index))
        except Exception:  # naming the holders must never turn a warning into an error
            return True
        if outside:
            gib = 1 << 30
            largest = "; ".join(
                f"{s.bytes / gib:.2f} GiB at {s.site or 'an unrecorded site'}"
                for s in outside[:3]
            )
            record.msg = (
                f"{record.getMessage()}. torch holds "
                f"{sum(s.bytes for s in outside) / gib:.2f} GiB of it outside every tag, "
                f"the largest: {largest}"
            )
            record.args = ()
        return True


def _torch_if_imported() -> Any:
    """torch, if this process imported it (a warning never imports it)."""
    return sys.modules.get("torch")


logging.getLogger("gpu_pager").addFilter(_NameTorchHolders())
