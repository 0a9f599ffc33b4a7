//! Release and resume of a set of tags. Each locked region gets a [`Part`] (what this call
//! does to it, and what each step took, for the report); every step runs over all parts
//! before the next starts, so that a failure at any step leaves every region as it was.

use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use super::companions::{self, Moving, Phase};
use super::{Pager, ReleaseOptions, ResumeOptions};
use crate::backend::{Backend, Fence, RawStream};
use crate::backup::Saved;
use crate::error::{Error, Result};
use crate::pump::{self, PumpStats, Sink};
use crate::region::{EarlyUnmap, Policy, Region, Unmapped, remember};
use crate::report::{Move, Outcome, RegionReport, Report, Steps};

/// The locked regions of one call, in tag order.
type Locked<'a> = [MutexGuard<'a, Region>];

/// One region's part in a release or resume.
#[derive(Default)]
struct Part {
    /// The call moves the region (it is resident for a release, released for a resume).
    moves: bool,
    /// Its contents cross the link: saved (a `Preserve` region not dropped) or restored.
    contents: bool,
    /// Release: its contents are dropped for this cycle.
    dropped: bool,
    steps: Steps,
    /// Bytes copied for it (a first backup's fill included).
    copied: usize,
    /// Release: bytes unmapped while the copies ran.
    unmapped_early: usize,
}

/// The release of `regions` (the locked regions of `tags`): checks the leases, waits for
/// device work, pins the backups, saves the contents, then unmaps.
pub(super) fn release(
    pager: &Pager,
    tags: &[&str],
    regions: &mut Locked<'_>,
    options: &ReleaseOptions,
) -> Result<Report> {
    let start = Instant::now();
    if let Some(r) = regions.iter().find(|r| r.is_resident() && r.leases() > 0) {
        return Err(Error::Busy {
            tag: r.tag.clone(),
            leases: r.leases(),
        });
    }
    let t = Instant::now();
    pager
        .backend
        .synchronize()
        .map_err(|e| Error::backend_of(tags, "waiting for device work", e))?;
    let sync = t.elapsed();
    let mut parts: Vec<Part> = regions
        .iter()
        .map(|r| {
            let moves = r.is_resident();
            let dropped = moves && options.drop.iter().any(|d| *d == r.tag);
            Part {
                moves,
                dropped,
                contents: moves && r.policy == Policy::Preserve && !dropped,
                ..Part::default()
            }
        })
        .collect();
    let companions = Moving::of(pager, &moving(regions, &parts));
    pin_backups(pager, regions, &mut parts)?;
    let copies = save_contents(pager, tags, regions, &mut parts, companions.is_empty())?;
    companions::run(
        pager,
        &companions,
        Phase::Release,
        &moving(regions, &parts),
        &held(regions),
    )?;
    let out = regions
        .iter_mut()
        .zip(&mut parts)
        .map(|(r, p)| unmap(pager.backend.as_ref(), r, p))
        .collect();
    Ok(report(Move::Release, sync, out, start, copies, regions))
}

/// Pins the backup of every region whose contents are saved (with `first_save_overlap`
/// a first backup is filled from the device in the same pass): all before any copy, so
/// that a failure leaves every region resident.
fn pin_backups(pager: &Pager, regions: &mut Locked<'_>, parts: &mut [Part]) -> Result<()> {
    let backend = pager.backend.as_ref();
    let gap = pager.config.tuning.copy_gap_bytes;
    let fill = pager.config.skip_unchanged && pager.config.tuning.first_save_overlap;
    for (r, p) in regions.iter_mut().zip(parts) {
        if !p.contents {
            continue;
        }
        if fill {
            let (pin, hash, copied) =
                r.first_backup_from_device(backend, gap, pager.config.tuning.hash_chunk_bytes)?;
            (p.steps.pin, p.steps.hash, p.copied) = (pin, hash, copied);
        }
        p.steps.pin += r.ensure_backup(backend, gap)?;
    }
    Ok(())
}

/// Copies the contents of every saved region to its backup through one pump, each
/// region (each buffer of a growing one) hashed while the copies of the ones before it
/// run; commits the saves once all succeeded.
///
/// Meanwhile it unmaps what it can (unless a moving tag has companions, which run between
/// the save and the unmap): each buffer whose whole contents are saved once its copies are
/// done, and the regions whose contents are not saved. On failure it maps and restores all
/// of that again ([`map_back`]), so that every region is resident as before; the regions
/// whose contents were to be dropped come back zero-filled (poisoned with
/// `poison_discards`; a `Discard` region uninitialised), as their resume would.
fn save_contents(
    pager: &Pager,
    tags: &[&str],
    regions: &mut Locked<'_>,
    parts: &mut [Part],
    early: bool,
) -> Result<PumpStats> {
    if !parts.iter().any(|p| p.contents) {
        return Ok(PumpStats::default());
    }
    let backend = pager.backend.as_ref();
    let c = &pager.config;
    let t = Instant::now();
    let mut saved = vec![Saved::default(); parts.len()];
    let mut unmapped = vec![Unmapped::default(); parts.len()];
    let scoped = pump::scope(
        backend,
        pager.pump_config(c.save_route),
        &pager.traffic,
        |p| {
            let mut unmaps: Vec<(usize, EarlyUnmap<'_>)> = Vec::new();
            let mut done = Ok(());
            for (i, ((r, part), s)) in regions
                .iter_mut()
                .zip(parts.iter())
                .zip(&mut saved)
                .enumerate()
            {
                // Not an elastic region: what it backs is the caller's to say, so a failed
                // release could not map it again.
                let early = early && (r.growing() || !r.on_demand());
                if part.contents {
                    let (sv, u) = r.save(
                        backend,
                        c.skip_unchanged,
                        c.tuning.hash_chunk_bytes,
                        c.tuning.copy_gap_bytes,
                        early,
                        p,
                    );
                    unmaps.extend(u.map(|u| (i, u)));
                    match sv {
                        Ok(sv) => *s = sv,
                        Err(e) => {
                            done = Err(e);
                            break;
                        }
                    }
                } else if part.moves && early {
                    unmaps.push((i, r.early_unmap_all()));
                }
            }
            if done.is_ok() {
                done = p
                    .drain(|pushed| unmaps.iter_mut().any(|(_, u)| u.step(pushed)))
                    .map_err(|e| Error::backend_of(tags, "copying contents to the host backup", e));
            }
            for (i, u) in unmaps {
                unmapped[i] = u.finish();
            }
            done
        },
        |e| Error::backend_of(tags, "copying contents to the host backup", e),
    );
    let pumped = match scoped {
        Ok(((), pumped)) => pumped,
        Err(e) => return Err(map_back(pager, regions, parts, &unmapped, e)),
    };
    // The copy time: the call's copying less its hashing, by each region's share.
    let hashing: Duration = saved.iter().map(|s| s.hash).sum();
    let bytes: Vec<usize> = saved.iter().map(|s| s.copied).collect();
    charge(parts, &bytes, t.elapsed().saturating_sub(hashing));
    for (((r, p), s), u) in regions
        .iter_mut()
        .zip(parts.iter_mut())
        .zip(&saved)
        .zip(&unmapped)
    {
        p.steps.hash += s.hash;
        p.copied += s.copied;
        p.steps.unmap += u.time;
        p.unmapped_early = u.bytes;
        if p.contents {
            r.commit_saves();
        }
    }
    Ok(pumped)
}

/// After a failed save: maps again what was unmapped while the copies ran, restoring each
/// saved region's buffers from their backups (their copies had finished) and filling a
/// region whose contents were to be dropped as its resume would. Returns `failure`, the
/// release's error. Where even that fails (the device is lost, or another thread took the
/// memory), the region is released instead, and the failure is recorded: its resume
/// restores the buffers this release had unmapped (their copies had finished), and every
/// other buffer comes back without contents.
fn map_back(
    pager: &Pager,
    regions: &mut Locked<'_>,
    parts: &[Part],
    unmapped: &[Unmapped],
    failure: Error,
) -> Error {
    let backend = pager.backend.as_ref();
    for ((r, p), u) in regions.iter_mut().zip(parts).zip(unmapped) {
        if u.extents.is_empty() {
            continue;
        }
        let back = if p.contents {
            r.commit_saves_within(&u.extents);
            let tag = r.tag.clone();
            pump::scope(
                backend,
                pager.pump_config(pager.config.restore_route),
                &pager.traffic,
                |pump| r.map_and_restore(backend, &mut Sink::Pump(pump), false),
                |e| Error::backend(&tag, "restoring what a failed release had unmapped", e),
            )
            .map(|_| ())
        } else {
            r.map_all(backend, "release").and_then(|_| {
                match lost_contents_pattern(pager, r, true) {
                    Some(pattern) => r.fill(backend, pattern).map(|_| ()),
                    None => Ok(()),
                }
            })
        };
        if let Err(e) = back {
            backend.deferred_errors().record(format!(
                "the release of `{}` failed ({failure}), and mapping back the memory it had \
                 unmapped failed too ({e}): the region is released; a resume restores the \
                 buffers it had unmapped after their copies finished, and every other buffer \
                 of the region comes back without contents",
                r.tag
            ));
            if let Err(sync) = backend.synchronize() {
                backend.deferred_errors().record(format!(
                    "synchronize before releasing `{}` after a failed release: {sync}",
                    r.tag
                ));
            }
            r.unmap_all(backend);
            if !p.contents {
                r.drop_contents();
            }
            r.set_released();
        }
    }
    failure
}

/// The 32-bit pattern that memory mapped for region `r` without its contents is filled
/// with: zeros for `DiscardZeroed` and for a `Preserve` region whose contents were dropped
/// (`dropped`), the poison instead with `poison_discards`, which also fills a `Discard`
/// region; `None`: left as it is (a `Discard` region's uninitialised memory, or a
/// `Preserve` region's restored contents).
fn lost_contents_pattern(pager: &Pager, r: &Region, dropped: bool) -> Option<u32> {
    let poison = pager.config.poison_discards.then_some(super::POISON);
    match r.policy {
        Policy::Discard => poison,
        Policy::DiscardZeroed => Some(0),
        Policy::Preserve if dropped => Some(poison.unwrap_or(0)),
        Policy::Preserve => None,
    }
}

/// The resume of `regions` (the locked regions of `tags`), on `stream` if given: maps
/// and restores, fills or verifies, then marks them resident; on any failure every
/// region the call mapped is unmapped again.
pub(super) fn resume(
    pager: &Pager,
    tags: &[&str],
    regions: &mut Locked<'_>,
    stream: Option<RawStream>,
    options: ResumeOptions,
) -> Result<Report> {
    let start = Instant::now();
    let mut parts: Vec<Part> = regions
        .iter()
        .map(|r| {
            let moves = !r.is_resident();
            Part {
                moves,
                contents: moves && r.policy == Policy::Preserve,
                ..Part::default()
            }
        })
        .collect();
    let companions = Moving::of(pager, &moving(regions, &parts));
    let backend = pager.backend.as_ref();
    let mut copies = PumpStats::default();
    // With `resume_on`, pager access waits for this fence before touching the contents.
    let mut fence: Option<Arc<dyn Fence>> = None;
    let done = map_and_restore(pager, tags, regions, &mut parts, stream)
        .map(|pumped| copies = pumped)
        .and_then(|()| fill_or_verify(pager, regions, &mut parts, stream.is_some()))
        .and_then(|()| match stream {
            Some(s) => backend
                .fence(s)
                .map(|f| fence = Some(Arc::from(f)))
                .map_err(|e| Error::backend_of(tags, "recording the restore's fence", e)),
            None => Ok(()),
        })
        .and_then(|()| {
            companions::run(
                pager,
                &companions,
                Phase::Resume,
                &moving(regions, &parts),
                &held(regions),
            )
        });
    if let Err(e) = done {
        undo_resume(backend, tags, regions, &parts);
        return Err(e);
    }
    let give_back = !options.keep_host_backups
        && regions
            .iter()
            .zip(&parts)
            .any(|(r, p)| p.moves && r.medium.gives_back_after_resume());
    if give_back {
        fence = settle(backend, tags, fence);
    }
    let out = regions
        .iter_mut()
        .zip(&parts)
        .map(|(r, p)| {
            if !p.moves {
                return already(&r.tag);
            }
            r.set_resident(fence.clone());
            if give_back && fence.is_none() {
                r.give_back_host_backups();
            }
            let bytes = r.mapped_bytes();
            done_report(r, p, bytes)
        })
        .collect();
    Ok(report(
        Move::Resume,
        Duration::ZERO,
        out,
        start,
        copies,
        regions,
    ))
}

/// Maps every moved region and restores the contents of the `Preserve` ones: the ones
/// without contents first (cheap, and an out-of-memory shows before any copy starts),
/// then the rest through one pump fed while they map, or on the caller's `stream`.
fn map_and_restore(
    pager: &Pager,
    tags: &[&str],
    regions: &mut Locked<'_>,
    parts: &mut [Part],
    stream: Option<RawStream>,
) -> Result<PumpStats> {
    let backend = pager.backend.as_ref();
    for (r, p) in regions.iter_mut().zip(parts.iter_mut()) {
        if p.moves && !p.contents {
            p.steps.map = r.map_all(backend, "resume")?;
        }
    }
    if !parts.iter().any(|p| p.contents) {
        return Ok(PumpStats::default());
    }
    let overlap = pager.config.tuning.overlap_restore;
    let Some(stream) = stream else {
        let ((), pumped) = pump::scope(
            backend,
            pager.pump_config(pager.config.restore_route),
            &pager.traffic,
            |p| restore_all(&mut *regions, parts, backend, &mut Sink::Pump(p), overlap),
            |e| Error::backend_of(tags, "restoring contents from the backup", e),
        )?;
        // The wait at the end is copy time not hidden behind mapping: charged to the
        // restored regions by their share of the bytes.
        let bytes: Vec<usize> = parts.iter().map(|p| p.copied).collect();
        charge(parts, &bytes, pumped.waited);
        return Ok(pumped);
    };
    let sink = &mut Sink::Stream {
        backend,
        stream,
        mover: pager.config.tuning.stream_mover,
    };
    restore_all(regions, parts, backend, sink, overlap)?;
    Ok(PumpStats::default())
}

/// Zero-fills what comes back zeroed (`DiscardZeroed`, or contents dropped at the
/// release), poisons what comes back without contents with `poison_discards`, and, with
/// `verify_restore` and no caller's stream, checks restored contents.
fn fill_or_verify(
    pager: &Pager,
    regions: &mut Locked<'_>,
    parts: &mut [Part],
    on_stream: bool,
) -> Result<()> {
    let backend = pager.backend.as_ref();
    let verify = pager.config.verify_restore && !on_stream;
    for (r, p) in regions.iter_mut().zip(parts.iter_mut()) {
        if !p.moves {
            continue;
        }
        if let Some(pattern) = lost_contents_pattern(pager, r, r.zero_on_resume()) {
            p.steps.fill = r.fill(backend, pattern)?;
        } else if r.policy == Policy::Preserve && verify {
            let t = Instant::now();
            r.verify(backend, pager.config.tuning.hash_chunk_bytes)?;
            p.steps.hash = t.elapsed();
        }
    }
    Ok(())
}

/// Maps and restores each region whose contents are restored, into `sink`.
fn restore_all<'h>(
    regions: &'h mut Locked<'_>,
    parts: &mut [Part],
    backend: &dyn Backend,
    sink: &mut Sink<'_, '_, 'h>,
    overlap: bool,
) -> Result<()> {
    for (r, p) in regions.iter_mut().zip(parts.iter_mut()) {
        if p.contents {
            let t = Instant::now();
            (p.steps.map, p.copied) = r.map_and_restore(backend, sink, overlap)?;
            p.steps.copy = t.elapsed().saturating_sub(p.steps.map);
        }
    }
    Ok(())
}

/// Undoes a failed resume: lets every copy and fill finish first (a `resume_on`'s copies may
/// still be in flight on the caller's stream into what the call mapped; if even that fails
/// the context is broken and runs nothing more), then unmaps what the call mapped.
fn undo_resume(backend: &dyn Backend, tags: &[&str], regions: &mut Locked<'_>, parts: &[Part]) {
    if let Err(sync) = backend.synchronize() {
        backend.deferred_errors().record(format!(
            "synchronize after a failed resume of {tags:?} (the resume's own error was \
             returned): {sync}"
        ));
    }
    for (r, p) in regions.iter_mut().zip(parts) {
        if p.moves {
            r.unmap_all(backend);
        }
    }
}

/// Every region a move holds locked, for its companions' queries.
fn held<'a>(regions: &'a Locked<'_>) -> Vec<&'a Region> {
    regions.iter().map(|g| &**g).collect()
}

/// The tags of the regions this call moves.
fn moving<'a>(regions: &'a Locked<'_>, parts: &[Part]) -> Vec<&'a str> {
    regions
        .iter()
        .zip(parts)
        .filter(|(_, p)| p.moves)
        .map(|(r, _)| r.tag.as_str())
        .collect()
}

/// Waits for a restore still in flight on the caller's stream before the host backups are
/// given back: `None` once it is over, the fence again when the wait failed (the backups are
/// then kept).
fn settle(
    backend: &dyn Backend,
    tags: &[&str],
    fence: Option<Arc<dyn Fence>>,
) -> Option<Arc<dyn Fence>> {
    let f = fence?;
    match f.wait() {
        Ok(()) => None,
        Err(e) => {
            backend.deferred_errors().record(format!(
                "waiting for the restore of {tags:?} before giving its host backups back \
                 (they are kept): {e}"
            ));
            Some(f)
        }
    }
}

/// The release's last step for one region: unmaps it, drops its contents if asked, marks it
/// released.
fn unmap(backend: &dyn Backend, r: &mut Region, p: &mut Part) -> RegionReport {
    if !p.moves {
        return already(&r.tag);
    }
    let (bytes, unmap) = r.unmap_all(backend);
    p.steps.unmap += unmap;
    let bytes = bytes + p.unmapped_early;
    if p.dropped {
        r.drop_contents();
    }
    r.set_released();
    done_report(r, p, bytes)
}

/// Adds `time` to the copy step of each part by its share of `bytes`.
fn charge(parts: &mut [Part], bytes: &[usize], time: Duration) {
    let total: usize = bytes.iter().sum();
    if total == 0 {
        return;
    }
    for (p, &b) in parts.iter_mut().zip(bytes) {
        p.steps.copy += time.mul_f64(b as f64 / total as f64);
    }
}

/// The call's report, also remembered by each region.
fn report(
    op: Move,
    sync: Duration,
    regions_out: Vec<RegionReport>,
    start: Instant,
    copies: PumpStats,
    regions: &mut Locked<'_>,
) -> Report {
    let report = Report {
        op,
        sync,
        regions: regions_out,
        total: start.elapsed(),
        copies,
    };
    for r in regions.iter_mut() {
        remember(&report, r);
    }
    report
}

/// The report of a region the call moved.
fn done_report(r: &Region, p: &Part, bytes: usize) -> RegionReport {
    RegionReport {
        tag: r.tag.clone(),
        outcome: Outcome::Done,
        bytes,
        copied: p.copied,
        steps: p.steps,
    }
}

/// The report of a region that was already where the call would move it.
pub(super) fn already(tag: &str) -> RegionReport {
    RegionReport {
        tag: tag.to_owned(),
        outcome: Outcome::AlreadyDone,
        bytes: 0,
        copied: 0,
        steps: Steps::default(),
    }
}
