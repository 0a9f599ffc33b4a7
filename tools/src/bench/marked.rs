//! Rows of update-aware release: the weights' buffers marked "overwritten by the next
//! update" ([`gpu_pager::Pager::set_overwritten`]), so that a release neither hashes nor
//! copies them and a resume only maps them.
//!
//! - every buffer marked: release and resume against the bare unmap and map of the same
//!   chunks (alternated, same driver state), and against the 20 ms target;
//! - half the buffers marked, contents changed: against the unmarked bytes over the link,
//!   and against the target, 20 ms per 16 GiB plus the unmarked bytes over the link;
//! - the RL wake-up: release the KV cache and the weights (all marked but a few small
//!   non-parameter buffers), a trainer's allocate/write/free, resume the weights, the
//!   update (the fill kernel over every marked buffer), resume the KV cache; against one
//!   pass of the weights over the link.
//!
//! Runs with `weights` resident and its backup current, `kv_cache` created; leaves the
//! weights resident and unmarked, the extra buffers freed.

use std::time::{Duration, Instant};

use gpu_pager::backend::Direction;
use gpu_pager::{Buffer, Error, Pager, Result};

use super::{BenchConfig, Link, OverLink, Row, Spread, over_link, trainer_step, write_weights};

const GIB: usize = 1 << 30;
const MIB: usize = 1 << 20;

/// Sets the marks of `bufs`: `marked(i)` for buffer `i`.
fn mark(pager: &Pager, bufs: &[Buffer], marked: impl Fn(usize) -> bool) -> Result<()> {
    for (i, b) in bufs.iter().enumerate() {
        pager.set_overwritten(b, 0..b.len(), marked(i))?;
    }
    Ok(())
}

/// The steps of the weights' part of `r`.
pub(super) fn steps(r: &gpu_pager::Report) -> gpu_pager::Steps {
    r.region("weights").map(|w| w.steps).unwrap_or_default()
}

/// "sync 0.1 ms, hash 2.0 ms, copy 160.2 ms, map 0.0 ms, unmap 11.9 ms": the medians of
/// each step over `samples` of (the call's wait for the device, its steps).
pub(super) fn breakdown(samples: &[(Duration, gpu_pager::Steps)]) -> String {
    let median = |f: &dyn Fn(&(Duration, gpu_pager::Steps)) -> Duration| {
        super::ms(Spread::of(&samples.iter().map(f).collect::<Vec<_>>()).median)
    };
    format!(
        "sync {:.1} ms, hash {:.1} ms, copy {:.1} ms, map {:.1} ms, unmap {:.1} ms",
        median(&|s| s.0),
        median(&|s| s.1.hash),
        median(&|s| s.1.copy),
        median(&|s| s.1.map),
        median(&|s| s.1.unmap)
    )
}

fn whole_hash(pager: &Pager, b: &Buffer) -> Result<u64> {
    Ok(pager.hash(b, b.len().next_multiple_of(16))?[0])
}

/// Appends the rows; see the module's docs.
pub(super) fn rows(
    pager: &Pager,
    cfg: &BenchConfig,
    link: &Link,
    bufs: &[Buffer],
    repeats: usize,
    log: &mut dyn FnMut(&str),
    rows: &mut Vec<Row>,
) -> Result<()> {
    let backend = pager.backend().clone();
    let b = backend.as_ref();
    let gib = |n: usize| n as f64 / GIB as f64;
    let w = ["weights"];

    // ---- every buffer marked -------------------------------------------------------
    log("weights, every buffer marked: release/resume alternated with bare VMM of the same chunks");
    mark(pager, bufs, |_| true)?;
    let size = pager.info("weights")?.size;
    let chunk = pager.config().chunk_bytes;
    let mut bare = super::Bare::new(b, size)?;
    let (mut rel, mut res, mut bmap, mut bunmap) = (vec![], vec![], vec![], vec![]);
    let mut copied = 0;
    for _ in 0..repeats * 3 {
        let r = pager.release(&w)?;
        rel.push(r.total);
        copied += r.copied();
        let (m, u) = bare.cycle(b, chunk)?;
        bmap.push(m);
        bunmap.push(u);
        let r = pager.resume(&w)?;
        res.push(r.total);
        copied += r.copied();
    }
    if copied > 0 {
        log(&format!(
            "WARNING: with every buffer marked the moves copied {copied} bytes (want 0)"
        ));
    }
    let chunks = size.div_ceil(chunk);
    rows.push(Row {
        name: format!("release weights, every buffer marked ({copied} bytes copied)"),
        figure: Spread::of(&rel),
        limit: Spread::of(&bunmap),
        limit_name: format!("bare unmap+release, {chunks} chunks"),
        target: Some(1.1),
        over: None,
    });
    rows.push(Row {
        name: "resume weights, every buffer marked".into(),
        figure: Spread::of(&res),
        limit: Spread::of(&bmap),
        limit_name: format!("bare create+map+set-access, {chunks} chunks"),
        target: Some(1.1),
        over: None,
    });
    let budget = Duration::from_millis(20).mul_f64(cfg.weights_bytes as f64 / (16 * GIB) as f64);
    for (what, samples) in [("release", &rel), ("resume", &res)] {
        rows.push(Row {
            name: format!("{what} weights, every buffer marked, against the target"),
            figure: Spread::of(samples),
            limit: Spread::of(&[budget]),
            limit_name: "20 ms per 16 GiB (target)".into(),
            target: Some(1.0),
            over: None,
        });
    }

    // ---- half the buffers marked ---------------------------------------------------
    log("weights, every other buffer marked: release after an update, resume 1 s later");
    mark(pager, bufs, |i| i % 2 == 1)?;
    let (mut rel, mut res) = (vec![], vec![]);
    let (mut rel_steps, mut res_steps) = (vec![], vec![]);
    let (mut saved, mut restored) = (0, 0);
    for rep in 0..repeats {
        write_weights(pager, bufs, 1000 + rep as u32)?;
        let r = pager.release(&w)?;
        rel.push(r.total);
        rel_steps.push((r.sync, steps(&r)));
        saved = r.copied();
        std::thread::sleep(Duration::from_secs(1));
        let r = pager.resume(&w)?;
        res.push(r.total);
        res_steps.push((r.sync, steps(&r)));
        restored = r.copied();
    }
    log(&format!(
        "half marked, release: {}; resume: {} (medians)",
        breakdown(&rel_steps),
        breakdown(&res_steps)
    ));
    let halves = [
        (
            "release weights, half the buffers marked, contents changed",
            &rel,
            saved,
            Direction::ToHost,
        ),
        (
            "resume weights, half the buffers marked, 1 s after",
            &res,
            restored,
            Direction::ToDevice,
        ),
    ];
    for (name, samples, unmarked, direction) in halves {
        let (way, over) = over_link(direction, unmarked);
        rows.push(Row::over_link(
            name,
            samples,
            over,
            link,
            format!("{:.2} GiB unmarked / {way}", gib(unmarked)),
            None,
        ));
        rows.push(Row::over_link(
            format!("{name}, against the target"),
            samples,
            over.plus(budget),
            link,
            format!(
                "20 ms per 16 GiB + {:.2} GiB unmarked / {way} (target)",
                gib(unmarked)
            ),
            Some(1.0),
        ));
    }

    // ---- the RL wake-up ------------------------------------------------------------
    // A few small buffers that are not parameters (rotary caches, quantization scales):
    // unmarked, they must survive bit-exact.
    let small = (cfg.weights_bytes / 4096).clamp(4096, 4 * MIB);
    let extras: Vec<Buffer> = (0..4)
        .map(|k| pager.alloc("weights", small + k * 1000 + 5))
        .collect::<Result<_>>()?;
    for (k, e) in extras.iter().enumerate() {
        pager.fill(e, 0xC0DE_0000 + k as u32)?;
    }
    let want: Vec<u64> = extras
        .iter()
        .map(|e| whole_hash(pager, e))
        .collect::<Result<_>>()?;
    mark(pager, bufs, |_| true)?;
    log(&format!(
        "RL wake-up: release kv_cache+weights (all marked but {} small buffers), trainer, \
         resume weights, update, resume kv_cache",
        extras.len()
    ));
    pager.resume(&["kv_cache"])?;
    let margin = 2 * GIB;
    let (mut total, mut stages) = (vec![], [vec![], vec![], vec![], vec![]]);
    for rep in 0..repeats {
        let r = pager.release(&["kv_cache", "weights"])?;
        stages[0].push(r.total);
        trainer_step(b, margin)?;
        let r = pager.resume(&w)?;
        stages[1].push(r.total);
        let t = Instant::now();
        write_weights(pager, bufs, 2000 + rep as u32)?;
        stages[2].push(t.elapsed());
        let r = pager.resume(&["kv_cache"])?;
        stages[3].push(r.total);
        total.push(stages.iter().map(|s| s[rep]).sum());
        for (k, e) in extras.iter().enumerate() {
            if whole_hash(pager, e)? != want[k] {
                return Err(Error::Corrupted {
                    tag: "weights".into(),
                    offset: e.offset(),
                });
            }
        }
    }
    let names = ["release", "resume weights", "update", "resume kv_cache"];
    let breakdown: Vec<String> = names
        .iter()
        .zip(&stages)
        .map(|(n, s)| format!("{n} {:.1} ms", super::ms(Spread::of(s).median)))
        .collect();
    log(&format!(
        "RL wake-up stages (medians): {}",
        breakdown.join(", ")
    ));
    rows.push(Row::over_link(
        "RL wake-up: release kv+weights (marked), resume weights, update, resume kv \
         (trainer excluded)",
        &total,
        OverLink::h2d(cfg.weights_bytes),
        link,
        format!("{:.2} GiB weights / H2D (one pass)", gib(cfg.weights_bytes)),
        None,
    ));

    for e in &extras {
        pager.free(e)?;
    }
    mark(pager, bufs, |_| false)?;
    Ok(())
}
