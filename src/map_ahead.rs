//! How a resume maps a region: groups of back-to-back pieces of doubling size, mapped in
//! order, either on the calling thread or ahead of it on a helper thread while the calling
//! thread keeps the copy pump fed.
//!
//! Why a helper thread: the pump is fed by the thread that pushes to it, so while that
//! thread sat in a map call no unit started, and the copy kernel ran dry. Right after a
//! trainer's free, `cuMemCreate` waits for the driver to scrub the freed memory (for about a
//! second), and `cuMemSetAccess` is many times slower while the copy kernel runs, without
//! slowing the kernel. Mapping ahead on a helper lets those waits overlap the copies
//! instead of stalling them.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::backend::{Backend, BackendError, BackendResult, Mapping, Reservation};
use crate::mapped::pieces;

/// Mapping groups of a resume hold at most this many bytes (unless one piece is larger): 2
/// GiB, so that the copies of one group outlast the mapping of the next.
pub const MAX_MAP_GROUP_BYTES: usize = 2 << 30;

/// How the error of a map call made ahead is recorded in the backend's
/// [`crate::backend::DeferredErrors`] when the resume had already failed for another
/// reason (the resume returns its own error).
pub const ABSORBED_MAP_ERROR: &str = "a mapping made ahead failed after its resume had failed";

/// How long the calling thread waits for the next group before it feeds the pump again.
const WAIT: Duration = Duration::from_micros(50);

/// What one map call gives.
type Maps = BackendResult<Vec<Box<dyn Mapping>>>;

/// One backend map call: pieces that lie back to back, one physical handle each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Group {
    /// Region offset of the first piece.
    pub offset: usize,
    /// The pieces' sizes, in address order.
    pub sizes: Vec<usize>,
    /// The wanted ranges of the group's run, as indices into the planned list.
    pub run: Range<usize>,
    /// Whether the run has contents to restore.
    pub restores: bool,
}

impl Group {
    /// The region bytes the group maps.
    pub fn span(&self) -> Range<usize> {
        self.offset..self.offset + self.sizes.iter().sum::<usize>()
    }
}

/// The groups that map `wanted` (sorted, disjoint region ranges): each range cut into
/// pieces of at most `chunk_bytes`, ranges that lie back to back forming a run. A run with
/// contents to restore (`restores` says which ranges have) is mapped in groups of 1, 2,
/// 4, … pieces, at most [`MAX_MAP_GROUP_BYTES`] each unless one piece is larger, so that
/// its first copies start early; with `overlap` off, or nothing to restore, a run is one
/// group.
pub(crate) fn plan(
    wanted: &[Range<usize>],
    chunk_bytes: usize,
    overlap: bool,
    restores: impl Fn(&Range<usize>) -> bool,
) -> Vec<Group> {
    let mut groups = Vec::new();
    let mut start = 0;
    for k in 1..=wanted.len() {
        if k < wanted.len() && wanted[k].start == wanted[k - 1].end {
            continue;
        }
        let run = start..k;
        start = k;
        // Every piece of the run, as (region offset, bytes), in address order.
        let all: Vec<(usize, usize)> = wanted[run.clone()]
            .iter()
            .flat_map(|r| {
                let mut at = r.start;
                pieces(r, chunk_bytes).into_iter().map(move |n| {
                    at += n;
                    (at - n, n)
                })
            })
            .collect();
        let restoring = wanted[run.clone()].iter().any(&restores);
        let grow = overlap && restoring;
        let mut count = if grow { 1 } else { all.len() };
        let mut first = 0;
        while first < all.len() {
            let mut last = (first + count).min(all.len());
            if grow {
                // Cap the group's bytes (but always take one piece).
                let mut bytes = 0;
                for (k, &(_, n)) in all[first..last].iter().enumerate() {
                    bytes += n;
                    if k > 0 && bytes > MAX_MAP_GROUP_BYTES {
                        last = first + k;
                        break;
                    }
                }
            }
            groups.push(Group {
                offset: all[first].0,
                sizes: all[first..last].iter().map(|&(_, n)| n).collect(),
                run: run.clone(),
                restores: restoring,
            });
            first = last;
            count = count.saturating_mul(2);
        }
    }
    groups
}

/// Maps `groups` in order into `reservation` and hands each group's mappings (or the map
/// call's error, which `each` returns as its own) to `each` as soon as they are made.
/// With `ahead`, a helper thread makes the map calls, as far ahead as it gets, and the
/// calling thread calls `idle` (which feeds the pump) while it waits for the next group;
/// else the calling thread maps each group just before its `each`. Both get `state` (the
/// sink the copies go to).
///
/// Which map calls a failing resume makes depends on timing: the helper may or may not
/// have started the next group's call when the calling thread fails (fault-injection
/// tests that count map calls see that).
///
/// Stops at the first error of `each` or `idle`; mappings made for groups not yet handed
/// on are then dropped (unmapped: nothing was copied into them), and a later map call's
/// error is recorded as [`ABSORBED_MAP_ERROR`]. Returns the time the calling thread spent
/// mapping or waiting for mappings.
///
/// # Safety
/// `reservation` comes from `backend`'s [`Backend::reserve`], and the groups' spans are
/// pairwise disjoint, lie inside it and are unmapped there (as [`Backend::map`] needs).
pub(crate) unsafe fn map_in_order<S: ?Sized, E>(
    backend: &dyn Backend,
    reservation: &Arc<dyn Reservation>,
    groups: &[Group],
    ahead: bool,
    state: &mut S,
    mut idle: impl FnMut(&mut S) -> Result<(), E>,
    mut each: impl FnMut(&mut S, &Group, Maps) -> Result<(), E>,
) -> Result<Duration, E> {
    // SAFETY: forwarded from this function's contract, group by group.
    let map = |g: &Group| unsafe { backend.map(reservation, g.offset, &g.sizes) };
    let inline = |state: &mut S, each: &mut dyn FnMut(&mut S, &Group, Maps) -> Result<(), E>| {
        let mut waited = Duration::ZERO;
        for g in groups {
            let t = Instant::now();
            let maps = map(g);
            waited += t.elapsed();
            each(state, g, maps)?;
        }
        Ok(waited)
    };
    if !ahead || groups.len() < 2 {
        return inline(state, &mut each);
    }
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel::<Maps>();
        let stop = &stop;
        let helper = std::thread::Builder::new()
            .name("gpu-pager-map".to_owned())
            .spawn_scoped(s, move || {
                for g in groups {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let maps = map(g);
                    let failed = maps.is_err();
                    // A closed channel: the calling thread stopped; the mappings drop here.
                    if tx.send(maps).is_err() || failed {
                        break;
                    }
                }
            });
        if helper.is_err() {
            // No thread to be had: map on this one.
            return inline(state, &mut each);
        }
        let mut waited = Duration::ZERO;
        let result = (|| {
            for g in groups {
                let t = Instant::now();
                let maps = loop {
                    match rx.recv_timeout(WAIT) {
                        Ok(maps) => break maps,
                        Err(mpsc::RecvTimeoutError::Timeout) => idle(state)?,
                        // The helper sends one result per group up to the first error,
                        // which ends this loop first: it hangs up early only if a map call
                        // panicked (the scope then re-raises that panic).
                        Err(mpsc::RecvTimeoutError::Disconnected) => {
                            break Err(BackendError::Internal {
                                op: "map",
                                reason: "the mapping thread ended early".to_owned(),
                            });
                        }
                    }
                };
                waited += t.elapsed();
                each(state, g, maps)?;
            }
            Ok(waited)
        })();
        if result.is_err() {
            stop.store(true, Ordering::Relaxed);
            // The helper stops before its next call; what it mapped and we did not take is
            // dropped (unmapped, nothing was copied into it). A call of its that failed
            // after this one had: its error cannot be returned as well, so it is recorded.
            for late in rx.iter() {
                if let Err(e) = late {
                    backend.deferred_errors().record(format!(
                        "{ABSORBED_MAP_ERROR}: {e} (the resume's own error was returned)"
                    ));
                }
            }
        }
        result
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    /// One wanted range.
    fn one(range: Range<usize>) -> Vec<Range<usize>> {
        vec![range]
    }

    /// Maps the groups of 16 MiB (1, 2, 4 and 1 pieces of 2 MiB) ahead on a helper thread
    /// and hands each on in order. (A map call of the helper's that fails after the resume
    /// failed is tested through the pager, in the integration tests.)
    #[test]
    fn groups_made_ahead_are_handed_on_in_order_and_all_mapped() {
        use crate::backend::host::{HostBackend, HostConfig};
        let host = HostBackend::new(HostConfig {
            capacity: 64 * MIB,
            granularity: 2 * MIB,
        });
        let reservation = host.reserve(16 * MIB).unwrap();
        let groups = plan(&one(0..16 * MIB), 2 * MIB, true, |_| true);
        assert_eq!(groups.len(), 4);
        let mut got: Vec<(usize, Vec<Box<dyn Mapping>>)> = Vec::new();
        // SAFETY: the reservation is the backend's, fresh, and the planned groups are
        // disjoint and inside it.
        let r = unsafe {
            map_in_order(
                &host,
                &reservation,
                &groups,
                true,
                &mut got,
                |_| Ok::<_, BackendError>(()),
                |got, g, maps| {
                    got.push((g.offset, maps?));
                    Ok(())
                },
            )
        };
        assert!(r.is_ok());
        let offsets: Vec<usize> = got.iter().map(|(o, _)| *o).collect();
        assert_eq!(offsets, [0, 2 * MIB, 6 * MIB, 14 * MIB]);
        assert_eq!(host.used_bytes(), 16 * MIB);
        drop(got);
        assert_eq!(host.used_bytes(), 0);
    }

    #[test]
    fn plan_doubles_groups_caps_them_and_splits_runs() {
        // 16 GiB fixed region in 512 MiB pieces: 1, 2, 4, 4, 4, ... pieces (2 GiB cap).
        let g = plan(&one(0..16 * 1024 * MIB), 512 * MIB, true, |_| true);
        let counts: Vec<usize> = g.iter().map(|g| g.sizes.len()).collect();
        assert_eq!(counts, [1, 2, 4, 4, 4, 4, 4, 4, 4, 1]);
        assert_eq!(
            g.iter().map(|g| g.span().len()).sum::<usize>(),
            16 * 1024 * MIB
        );
        for w in g.windows(2) {
            assert_eq!(w[0].span().end, w[1].span().start);
        }
        // Without overlap, or nothing to restore: one group per run.
        assert_eq!(
            plan(&one(0..4096 * MIB), 512 * MIB, false, |_| true).len(),
            1
        );
        assert_eq!(
            plan(&one(0..4096 * MIB), 512 * MIB, true, |_| false).len(),
            1
        );
        // A hole splits the runs; each group names its run.
        let wanted = [0..2 * MIB, 2 * MIB..6 * MIB, 8 * MIB..10 * MIB];
        let g = plan(&wanted, 2 * MIB, true, |r| r.start != 8 * MIB);
        let shape: Vec<(usize, usize, Range<usize>, bool)> = g
            .iter()
            .map(|g| (g.offset, g.sizes.len(), g.run.clone(), g.restores))
            .collect();
        assert_eq!(
            shape,
            [
                (0, 1, 0..2, true),
                (2 * MIB, 2, 0..2, true),
                (8 * MIB, 1, 2..3, false),
            ]
        );
        // A piece larger than the cap still forms a group of its own.
        let g = plan(&one(0..6144 * MIB), 3072 * MIB, true, |_| true);
        assert_eq!(g.iter().map(|g| g.sizes.len()).collect::<Vec<_>>(), [1, 1]);
    }
}
