//! Rows of the copy pump (`gpu_pager::pump`): the link as each mover sees it, the weights'
//! resume and release by route (settled, and right after a trainer's allocate/write/free or
//! a big release) ([`rows`]), and a release and a resume of two tags at once (both
//! directions of the link, [`both_directions_rows`]). Every figure is against the link
//! measured in the same run ([`Link`]).

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use gpu_pager::backend::{Backend, BackendKind, Direction, HostBuffer, Mover, RawCopy};
use gpu_pager::pump::{self, Pinned, PinnedMut, PumpConfig, PumpStats};
use gpu_pager::report::{gbps, ms};
use gpu_pager::{Buffer, CopyRoute, Error, Pager, Policy, RegionOptions, Report, Result};

use super::{
    BenchConfig, GIB, Link, OverLink, Row, Spread, backend_err, marked, over_link, size_name,
    timed_writes, trainer_step, write_weights,
};

/// The rows; see the module docs. Needs the `weights` region (buffers `bufs`) resident with
/// its backup current and `kv_cache` released; leaves them so (contents rewritten), with the
/// routes back at their defaults.
pub(super) fn rows(
    pager: &Pager,
    cfg: &BenchConfig,
    link: &Link,
    bufs: &[Buffer],
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    let settle = settle(pager);
    let repeats = cfg.repeats.clamp(1, 3);
    let defaults = pager.config();

    movers_rows(pager, cfg, link, log, rows)?;

    log(
        "weights by route: resume settled, right after a trainer's free, right after releasing kv_cache too",
    );
    let mut generation = 1000;
    for route in CopyRoute::ALL {
        pager.set_restore_route(route);
        pager.set_save_route(route);
        let (mut res_settled, mut res_after, mut res_kv) = (vec![], vec![], vec![]);
        let (mut rel_settled, mut rel_after, mut rel_kv) = (vec![], vec![], vec![]);
        let (mut restored, mut saved, mut saved_kv) = (0, 0, 0);
        let (mut split, mut split_settled) = (PumpStats::default(), PumpStats::default());
        // Where the settled moves spend their time, and how long the writes before the
        // settled release took (the fill kernel over every buffer).
        let (mut res_steps, mut rel_steps, mut writes) = (vec![], vec![], vec![]);
        for _ in 0..repeats {
            // Resume, settled.
            pager.release(&["weights"])?;
            std::thread::sleep(settle);
            let r = pager.resume(&["weights"])?;
            res_settled.push(r.total);
            res_steps.push((r.sync, marked::steps(&r)));
            split_settled.add(&r.copies);
            restored = r.copied();
            // Resume right after a trainer's allocate/write/free.
            pager.release(&["weights"])?;
            trainer_step(pager.backend().as_ref(), 2 * GIB)?;
            let r = pager.resume(&["weights"])?;
            res_after.push(r.total);
            split.add(&r.copies);
            // Release of changed weights, settled.
            generation += 1;
            writes.push(timed_writes(pager, bufs, generation)?);
            std::thread::sleep(settle);
            let r = pager.release(&["weights"])?;
            rel_settled.push(r.total);
            rel_steps.push((r.sync, marked::steps(&r)));
            saved = r.copied();
            pager.resume(&["weights"])?;
            // Release of changed weights right after a trainer's free.
            generation += 1;
            write_weights(pager, bufs, generation)?;
            trainer_step(pager.backend().as_ref(), 2 * GIB)?;
            let r = pager.release(&["weights"])?;
            rel_after.push(r.total);
            // kv_cache + changed weights in one release (the KV's memory goes back right
            // after the copies), then the weights' resume at once.
            pager.resume(&["weights", "kv_cache"])?;
            generation += 1;
            write_weights(pager, bufs, generation)?;
            let r = pager.release(&["kv_cache", "weights"])?;
            rel_kv.push(r.total);
            saved_kv = r.copied();
            let r = pager.resume(&["weights"])?;
            res_kv.push(r.total);
        }
        log(&format!(
            "{route}: resume right after a free moved {}; 1 s after the release {}",
            mover_split(&split),
            mover_split(&split_settled)
        ));
        log(&format!(
            "{route}: resume 1 s after the release: {}; writes {:.1} ms, then the release 1 s \
             after them: {} (medians)",
            marked::breakdown(&res_steps),
            ms(Spread::of(&writes).median),
            marked::breakdown(&rel_steps)
        ));
        let target = |t: f64| (route == defaults.restore_route).then_some(t);
        let save_target = |t: f64| (route == defaults.save_route).then_some(t);
        let row = |name: String, samples: &[Duration], over: OverLink, what: String, target| {
            Row::over_link(name, samples, over, link, what, target)
        };
        let gib = |n: usize| n as f64 / GIB as f64;
        rows.push(row(
            format!("resume weights, {route}, 1 s after the release"),
            &res_settled,
            OverLink::h2d(restored),
            format!("{:.2} GiB / H2D", gib(restored)),
            target(1.05),
        ));
        rows.push(row(
            format!("resume weights, {route}, right after a trainer's allocate/write/free"),
            &res_after,
            OverLink::h2d(restored),
            format!("{:.2} GiB / H2D", gib(restored)),
            target(1.15),
        ));
        rows.push(row(
            format!("resume weights, {route}, right after releasing kv_cache + weights"),
            &res_kv,
            OverLink::h2d(restored),
            format!("{:.2} GiB / H2D", gib(restored)),
            target(1.15),
        ));
        rows.push(row(
            format!("release weights (changed), {route}, 1 s after the writes"),
            &rel_settled,
            OverLink::d2h(saved),
            format!("{:.2} GiB / D2H", gib(saved)),
            save_target(1.05),
        ));
        rows.push(row(
            format!("release weights (changed), {route}, right after a trainer's free"),
            &rel_after,
            OverLink::d2h(saved),
            format!("{:.2} GiB / D2H", gib(saved)),
            None,
        ));
        rows.push(row(
            format!(
                "release kv_cache + weights (changed) in one call, {route} (unmaps {})",
                size_name(cfg.kv_bytes)
            ),
            &rel_kv,
            OverLink::d2h(saved_kv),
            format!("{:.2} GiB / D2H", gib(saved_kv)),
            None,
        ));
    }
    pager.set_restore_route(defaults.restore_route);
    pager.set_save_route(defaults.save_route);

    shape_rows(pager, link, settle, repeats, log, rows)?;

    pager.set_restore_route(defaults.restore_route);
    pager.set_save_route(defaults.save_route);
    Ok(())
}

/// The resume of the weights right after a trainer's free (and settled) under candidate
/// orders and shapes: mapping overlapped with the copies (the default: groups of doubling
/// size mapped ahead on a helper thread, each group's copies pushed as soon as it is
/// mapped; "map" is then the time the resume waited for mappings) or the whole region mapped first
/// (`Pager::set_overlap_restore(false)`), per route, and the copy units' size and depth
/// (`Pager::set_copy_units`). Logs each candidate's map time, copy wait and mover split, so
/// that the table says where the time went. Run C (BENCHMARKS.md, 2026-12-03, second
/// session) swept 64 MiB × 2, 64 MiB × 4 and 16 MiB × 8 units overlapped: all within 1% of
/// 256 MiB × 2, so only 256 MiB and 1 GiB units remain here.
fn shape_rows(
    pager: &Pager,
    link: &Link,
    settle: Duration,
    repeats: usize,
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    const MIB: usize = 1 << 20;
    let defaults = pager.config();
    log("copy order and shape against the resume right after a trainer's free");
    let after = true;
    let candidates = [
        // (overlap, unit, depth, route, right after a free)
        (true, 256 * MIB, 2, CopyRoute::Fastest, after),
        (true, 256 * MIB, 2, CopyRoute::Fastest, !after),
        (true, 256 * MIB, 2, CopyRoute::Kernel, after),
        (true, 256 * MIB, 2, CopyRoute::Adaptive, after),
        (true, 256 * MIB, 2, CopyRoute::Adaptive, !after),
        (true, 256 * MIB, 2, CopyRoute::Engine, !after),
        // More bytes in flight per mover.
        (true, 256 * MIB, 8, CopyRoute::Kernel, after),
        (true, 1024 * MIB, 2, CopyRoute::Fastest, after),
        // The whole region mapped first.
        (false, 256 * MIB, 2, CopyRoute::Kernel, after),
        (false, 256 * MIB, 2, CopyRoute::Fastest, after),
    ];
    for (overlap, unit, depth, route, after_free) in candidates {
        pager.set_overlap_restore(overlap);
        pager.set_copy_units(unit, depth);
        pager.set_restore_route(route);
        let (mut samples, mut maps, mut waits) = (vec![], vec![], vec![]);
        let (mut restored, mut split) = (0, PumpStats::default());
        for _ in 0..repeats {
            pager.release(&["weights"])?;
            if after_free {
                trainer_step(pager.backend().as_ref(), 2 * GIB)?;
            } else {
                std::thread::sleep(settle);
            }
            let r = pager.resume(&["weights"])?;
            samples.push(r.total);
            let steps = r.region("weights").map(|w| w.steps).unwrap_or_default();
            maps.push(steps.map);
            waits.push(steps.copy);
            split.add(&r.copies);
            restored = r.copied();
        }
        let when = if after_free {
            "right after a trainer's free"
        } else {
            "1 s after the release"
        };
        let order = if overlap {
            "mapped ahead while copying"
        } else {
            "mapped first"
        };
        let name = format!(
            "resume weights, {route}, {when}, {order}, units of {} MiB × {depth}",
            unit / MIB
        );
        log(&format!(
            "{name}: map {:.1} ms, copy wait after mapping {:.1} ms (medians); {}",
            gpu_pager::report::ms(Spread::of(&maps).median),
            gpu_pager::report::ms(Spread::of(&waits).median),
            mover_split(&split)
        ));
        rows.push(Row::over_link(
            name,
            &samples,
            OverLink::h2d(restored),
            link,
            format!("{:.2} GiB / H2D", restored as f64 / GIB as f64),
            None,
        ));
    }
    pager.set_overlap_restore(defaults.overlap_restore);
    pager.set_copy_units(defaults.copy_unit_bytes, defaults.copy_depth);
    pager.set_restore_route(defaults.restore_route);
    Ok(())
}

/// "copy engine 3.2 GiB, copy kernel 12.5 GiB (80%)".
pub(super) fn mover_split(s: &PumpStats) -> String {
    let total = s.total_bytes().max(1);
    Mover::ALL
        .iter()
        .map(|&m| {
            format!(
                "{} {:.1} GiB ({:.0}%)",
                m,
                s.bytes_by(m) as f64 / GIB as f64,
                100.0 * s.bytes_by(m) as f64 / total as f64
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The link as each mover sees it, settled: a pinned buffer of the link size copied whole
/// through a pump on one route (units of the pager's size), each way, best of three,
/// against the link measured with one plain copy-engine copy. Then the same copies on the
/// copy engine and the copy kernel after the device sat idle for a second
/// ([`idle_rows`]).
fn movers_rows(
    pager: &Pager,
    cfg: &BenchConfig,
    link: &Link,
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    let bytes = cfg.link_bytes();
    log(&format!(
        "the link per mover: {} each way through the pump, settled",
        size_name(bytes)
    ));
    let backend = pager.backend().clone();
    pager.region("bench_movers", bytes, Policy::Discard)?;
    let dev = pager.alloc("bench_movers", bytes)?;
    let dst = pager.ptr(&dev)?;
    let mut host = backend
        .alloc_pinned(bytes)
        .map_err(backend_err("bench_movers", "pinning"))?;
    for route in [CopyRoute::Engine, CopyRoute::Kernel, CopyRoute::Adaptive] {
        let pump_config = pump_on(pager, route);
        for direction in [Direction::ToDevice, Direction::ToHost] {
            let mut samples = Vec::new();
            let mut stats = PumpStats::default();
            for _ in 0..3 {
                let t = Instant::now();
                let ((), s) =
                    pump_whole(backend.as_ref(), pump_config, direction, host.as_mut(), dst)?;
                samples.push(t.elapsed());
                stats = s;
            }
            let (dir, over) = over_link(direction, bytes);
            let best = samples.iter().min().copied().unwrap_or_default();
            log(&format!(
                "{route} {dir}: {:.1} GB/s ({})",
                gbps(bytes, best),
                mover_split(&stats)
            ));
            rows.push(Row::over_link(
                format!(
                    "{route} {} {dir} through the pump, settled (best of 3)",
                    size_name(bytes)
                ),
                &[best],
                over,
                link,
                format!("{} / {dir} (one copy-engine copy)", size_name(bytes)),
                None,
            ));
        }
    }
    idle_rows(pager, link, &dev, host.as_mut(), log, rows)?;
    drop(host);
    pager.remove("bench_movers")?;
    Ok(())
}

/// The copies of [`movers_rows`] each way on the copy engine and on the copy kernel, each
/// after the device sat idle for a second (as the rows "1 s after" do), and device→host
/// also right after a fill kernel wrote the source and an idle second (as a release of
/// changed weights "1 s after the writes" does). Two samples each.
fn idle_rows(
    pager: &Pager,
    link: &Link,
    dev: &Buffer,
    host: &mut dyn HostBuffer,
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    let settle = settle(pager);
    let backend = pager.backend().clone();
    let dst = pager.ptr(dev)?;
    let bytes = host.len();
    log(&format!(
        "the link per mover after an idle second: {} each way",
        size_name(bytes)
    ));
    for route in [CopyRoute::Engine, CopyRoute::Kernel] {
        let pump_config = pump_on(pager, route);
        for (direction, written) in [
            (Direction::ToDevice, false),
            (Direction::ToHost, false),
            (Direction::ToHost, true),
        ] {
            let mut samples = Vec::new();
            for _ in 0..2 {
                if written {
                    pager.fill(dev, 0x5A5A_5A5A)?;
                }
                std::thread::sleep(settle);
                let t = Instant::now();
                pump_whole(backend.as_ref(), pump_config, direction, host, dst)?;
                samples.push(t.elapsed());
            }
            let (dir, over) = over_link(direction, bytes);
            let after = if written {
                "a fill of the source, then an idle second"
            } else {
                "an idle second"
            };
            let row = Row::over_link(
                format!(
                    "{route} {} {dir} through the pump, after {after}",
                    size_name(bytes)
                ),
                &samples,
                over,
                link,
                format!("{} / {dir} (one copy-engine copy)", size_name(bytes)),
                None,
            );
            log(&format!(
                "{route} {dir} after {after}: {:.1} GB/s (median of 2)",
                gbps(bytes, row.figure.median)
            ));
            rows.push(row);
        }
    }
    Ok(())
}

/// A pump of the pager's unit size and depth on `route`.
fn pump_on(pager: &Pager, route: CopyRoute) -> PumpConfig {
    let config = pager.config();
    PumpConfig {
        route,
        unit_bytes: config.copy_unit_bytes,
        depth: config.copy_depth,
    }
}

/// One pump scope copying all of `host` to or from device address `dev`, the live
/// `bench_movers` buffer of `host.len()` bytes.
fn pump_whole(
    backend: &dyn Backend,
    config: PumpConfig,
    direction: Direction,
    host: &mut dyn HostBuffer,
    dev: u64,
) -> Result<((), PumpStats)> {
    pump::scope(
        backend,
        config,
        &pump::Traffic::default(),
        |p| match direction {
            // SAFETY: `dev .. dev + host.len()` is the live, resident bench_movers buffer,
            // which nothing else touches meanwhile; `host` is this backend's pinned memory.
            Direction::ToDevice => unsafe { p.push_to_device(Pinned::new(host), dev) },
            // SAFETY: as above.
            Direction::ToHost => unsafe { p.push_to_host(dev, PinnedMut::new(host)) },
        },
        |e| e,
    )
    .map_err(|e| Error::backend("bench_movers", "copying", e))
}

/// Long enough on a GPU for the copy engine to recover from a free (about a second); the
/// host backend has no such effect.
fn settle(pager: &Pager) -> Duration {
    if pager.backend_kind() == BackendKind::Cuda {
        Duration::from_secs(1)
    } else {
        Duration::from_millis(50)
    }
}

/// Thread A releases the weights (contents changed) while thread B resumes another tag of
/// the same size: both directions of the link at once, the aggregate against one
/// direction's link (a duplex link moves both in the time of one: ratio 0.5; one direction
/// after the other: 1.0). With the default routes, with both on the copy engine, and with
/// the restore on the copy kernel (the save on the copy engine). Each sample 1 s after the
/// last move. Needs the weights (buffers `bufs`) resident with their backup current;
/// leaves them so, with the routes at their defaults.
pub(super) fn both_directions_rows(
    pager: &Pager,
    cfg: &BenchConfig,
    link: &Link,
    bufs: &[Buffer],
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    let settle = settle(pager);
    let repeats = cfg.repeats.clamp(1, 5);
    log(
        "both directions at once: the bare copies, then release the weights while another tag resumes",
    );
    if let Some(row) = bare_duplex_row(pager, cfg, link, repeats)? {
        rows.push(row);
    }
    pager.region_with(
        "weights_y",
        cfg.weights_bytes,
        Policy::Preserve,
        RegionOptions {
            prepin: true,
            ..Default::default()
        },
    )?;
    let y = pager.alloc("weights_y", cfg.weights_bytes - 4096)?;
    pager.fill(&y, 0x0F0F_0F0F)?;
    pager.release(&["weights_y"])?;
    let defaults = pager.config();
    let mut generation = 5000;
    for (name, restore, save) in [
        (
            "default routes",
            defaults.restore_route,
            defaults.save_route,
        ),
        (
            "both on the copy engine",
            CopyRoute::Engine,
            CopyRoute::Engine,
        ),
        (
            "restore on the copy kernel, save on the copy engine",
            CopyRoute::Kernel,
            CopyRoute::Engine,
        ),
    ] {
        pager.set_restore_route(restore);
        pager.set_save_route(save);
        let (mut both, mut alone_rel, mut alone_res) = (vec![], vec![], vec![]);
        let (mut saved_by, mut restored_by) = (PumpStats::default(), PumpStats::default());
        let mut moved = 0;
        for _ in 0..repeats {
            // The weights resident with changed contents, weights_y released.
            generation += 1;
            write_weights(pager, bufs, generation)?;
            std::thread::sleep(settle);
            let start = Arc::new(Barrier::new(2));
            let t = Instant::now();
            let (rel, res) = std::thread::scope(|s| {
                let go = start.clone();
                let a = s.spawn(move || {
                    go.wait();
                    let r = pager.release(&["weights"]);
                    (r, Instant::now())
                });
                let go = start.clone();
                let b = s.spawn(move || {
                    go.wait();
                    let r = pager.resume(&["weights_y"]);
                    (r, Instant::now())
                });
                (a.join(), b.join())
            });
            let joined = |r: std::thread::Result<(Result<Report>, Instant)>| {
                r.map_err(|_| Error::InvalidArgument {
                    tag: "weights".into(),
                    reason: "a bench thread panicked".into(),
                })
            };
            let (rel, rel_end) = joined(rel)?;
            let (res, res_end) = joined(res)?;
            let (rel, res) = (rel?, res?);
            both.push(rel_end.max(res_end) - t);
            alone_rel.push(rel.total);
            alone_res.push(res.total);
            saved_by.add(&rel.copies);
            restored_by.add(&res.copies);
            moved = rel.copied() + res.copied();
            // Back: the weights resident (restored), weights_y released (unchanged).
            pager.release(&["weights_y"])?;
            pager.resume(&["weights"])?;
        }
        let median = Spread::of(&both).median;
        log(&format!(
            "both directions, {name}: {:.1} GB/s together ({:.2}× one direction's link); \
             release {:.0} ms ({}), resume {:.0} ms ({})",
            gbps(moved, median),
            gbps(moved, median) / link.h2d_gbps,
            Spread::of(&alone_rel).median.as_secs_f64() * 1e3,
            mover_split(&saved_by),
            Spread::of(&alone_res).median.as_secs_f64() * 1e3,
            mover_split(&restored_by),
        ));
        rows.push(Row::over_link(
            format!(
                "release weights (changed) while resuming {} of another tag, {name}",
                size_name(cfg.weights_bytes)
            ),
            &both,
            OverLink::h2d(moved),
            link,
            format!(
                "{:.2} GiB / H2D (one direction); ≤ 0.625 is ≥ 1.6× its link",
                moved as f64 / GIB as f64
            ),
            (name == "default routes").then_some(0.625),
        ));
    }
    pager.set_restore_route(defaults.restore_route);
    pager.set_save_route(defaults.save_route);
    pager.remove("weights_y")?;
    Ok(())
}

/// The hardware's own duplex: a host→device and a device→host copy of the link probe's size
/// each, on the copy engine on two streams at once, against one direction's link for the
/// bytes of both (what the pager's both-directions rows can hope for). `None` on the host
/// backend (no streams).
fn bare_duplex_row(
    pager: &Pager,
    cfg: &BenchConfig,
    link: &Link,
    repeats: usize,
) -> Result<Option<Row>> {
    let b = pager.backend().as_ref();
    let Some((s1, s2)) = crate::bench::streams::two(b)? else {
        return Ok(None);
    };
    let bytes = cfg.link_bytes();
    let tag = "bench_duplex";
    let err = |op: &'static str| move |e| Error::backend(tag, op, e);
    pager.region(tag, 2 * bytes, Policy::Discard)?;
    let bufs = (pager.alloc(tag, bytes)?, pager.alloc(tag, bytes)?);
    let (to_dev, from_dev) = (pager.ptr(&bufs.0)?, pager.ptr(&bufs.1)?);
    let src = b.alloc_pinned(bytes).map_err(err("pinning"))?;
    let dst = b.alloc_pinned(bytes).map_err(err("pinning"))?;
    let mut samples = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let up = RawCopy::whole(Direction::ToDevice, src.as_ref(), to_dev);
        let down = RawCopy::whole(Direction::ToHost, dst.as_ref(), from_dev);
        let t = Instant::now();
        // SAFETY: both device ranges are live buffers of the resident bench_duplex region;
        // the host buffers are this backend's pinned memory, alive and not otherwise used
        // until both streams are synchronized below.
        unsafe { b.copy_on(&up, Mover::CopyEngine, s1.raw()) }.map_err(err("copy"))?;
        // SAFETY: as above.
        unsafe { b.copy_on(&down, Mover::CopyEngine, s2.raw()) }.map_err(err("copy"))?;
        s1.sync()?;
        s2.sync()?;
        samples.push(t.elapsed());
    }
    drop((src, dst));
    pager.remove(tag)?;
    Ok(Some(Row::over_link(
        format!(
            "bare: {} host→device and {} device→host at once, copy engine, two streams",
            size_name(bytes),
            size_name(bytes)
        ),
        &samples,
        OverLink::h2d(2 * bytes),
        link,
        format!(
            "{:.2} GiB / H2D (one direction): the link's own duplex factor",
            2.0 * bytes as f64 / GIB as f64
        ),
        None,
    )))
}
