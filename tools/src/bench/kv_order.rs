//! What the time to map the KV cache depends on: the pager's resume of 32 handles took
//! 185–200 ms where the bare loop of the same pattern, run right after the pager's release,
//! took 4–6 ms (BENCHMARKS.md, 2026-12-03). Both call the same backend `map`; they differ in
//! what was released just before (the same handle size or another, by the pager or the bare
//! loop) and in the virtual range. Each row here maps one pattern right after one kind of
//! release, so that the table tells which of those matters.

use std::time::Duration;

use gpu_pager::backend::Backend;
use gpu_pager::{Pager, Result};

use super::{Bare, Row, Spread};

/// Rows for the pager's region `tag` (released, mapped in handles of `chunk`) against the
/// bare loop `bare` over a reservation of the same size, with `other` a different handle
/// size: the pager's resume right after (a) its own release, (b) the bare loop's release
/// of the same handle size, (c) the bare loop's release of `other`-sized handles; and the
/// bare loop's map right after (d) its own release, (e) the pager's release. `name` names
/// the pattern, `other_name` the other one. Leaves `tag` released.
#[allow(clippy::too_many_arguments)]
pub(super) fn rows(
    pager: &Pager,
    backend: &dyn Backend,
    bare: &mut Bare,
    tag: &str,
    chunk: usize,
    other: usize,
    (name, other_name): (&str, &str),
    repeats: usize,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let (mut a, mut b, mut c, mut d, mut e) = (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..repeats {
        // (a) pager release → pager resume.
        pager.resume(&[tag])?;
        pager.release(&[tag])?;
        a.push(pager.resume(&[tag])?.total);
        pager.release(&[tag])?;
        // (b) bare release, same handles → pager resume.
        bare.cycle(backend, chunk)?;
        b.push(pager.resume(&[tag])?.total);
        pager.release(&[tag])?;
        // (c) bare release, other handles → pager resume.
        bare.cycle(backend, other)?;
        c.push(pager.resume(&[tag])?.total);
        pager.release(&[tag])?;
        // (d) bare release → bare map, same handles (the second cycle's map).
        bare.cycle(backend, chunk)?;
        d.push(bare.cycle(backend, chunk)?.0);
        // (e) pager release → bare map.
        pager.resume(&[tag])?;
        pager.release(&[tag])?;
        e.push(bare.cycle(backend, chunk)?.0);
    }
    let limit = Spread::of(&d);
    let mut row = |what: String, samples: &[Duration]| {
        rows.push(Row {
            name: what,
            figure: Spread::of(samples),
            limit,
            limit_name: format!("bare map {name} right after the bare unmap of {name}"),
            target: None,
            over: None,
        });
    };
    row(format!("pager maps {name} right after its own release"), &a);
    row(
        format!("pager maps {name} right after the bare unmap of {name}"),
        &b,
    );
    row(
        format!("pager maps {name} right after the bare unmap of {other_name}"),
        &c,
    );
    row(
        format!("bare map {name} right after the bare unmap of {name}"),
        &d,
    );
    row(
        format!("bare map {name} right after the pager's release"),
        &e,
    );
    Ok(())
}
