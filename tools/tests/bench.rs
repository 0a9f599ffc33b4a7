//! The benchmark table on the host backend: every group of rows runs, and every row whose
//! limit is bytes over the link is judged against the best link measure of the run (the
//! start's or the end's, each direction on its own), never against a low one.

use std::sync::Arc;
use std::time::Duration;

use gpu_pager::backend::host::{HostBackend, HostConfig};
use gpu_pager_tools::bench::{self, BenchConfig, Link, OverLink};

#[test]
fn rows_over_the_link_are_judged_against_the_best_measure_of_the_run() {
    let backend = Arc::new(HostBackend::new(HostConfig {
        capacity: 4 << 30,
        granularity: 2 << 20,
    }));
    let cfg = BenchConfig {
        weights_bytes: 64 << 20,
        kv_bytes: 256 << 20,
        chunk_bytes: 16 << 20,
        repeats: 1,
        weight_buffers: 12,
        cold_release: true,
        alloc_sizes: vec![2 << 20],
        ..BenchConfig::small()
    };
    let table = bench::run(backend.clone(), &cfg, &mut |_| {}).expect("the bench runs");
    // Every group of rows ran (the growing rows once asked for a fixed region of 0 bytes).
    for row in [
        "first release, backup pinned ahead",
        "first release, no prepin, fixed region",
        "first release, no prepin, growing region (12 buffers)",
        "resume KV",
        "growing region (12 buffers): resume weights",
        "alloc 2 MiB",
        "resume weights right after a trainer",
        "release weights, every buffer marked",
        "RL wake-up",
    ] {
        assert!(
            table.rows.iter().any(|r| r.name.starts_with(row)),
            "no row `{row}`: {table}"
        );
    }
    assert_eq!(table.link, table.link_start.best(&table.link_end));
    let over: Vec<_> = table.rows.iter().filter(|r| r.over.is_some()).collect();
    assert!(
        over.len() >= 5,
        "the copy rows, the after-free rows and the marked rows are over the link"
    );
    for r in over {
        let want = r.over.map(|o| o.time(&table.link));
        assert_eq!(Some(r.limit.median), want, "{}", r.name);
    }
    let shown = table.to_string();
    assert!(
        shown.contains("at the start") && shown.contains("at the end"),
        "{shown}"
    );
    assert_eq!(backend.used_bytes(), 0, "the bench gives every byte back");
}

#[test]
fn a_limit_over_the_link_adds_each_direction_and_its_fixed_part() {
    let link = Link {
        h2d_gbps: 50.0,
        d2h_gbps: 25.0,
        h2d_fresh_gbps: 40.0,
    };
    let over = OverLink::h2d(50_000_000)
        .plus(Duration::from_millis(20))
        .plus(Duration::from_millis(5));
    assert_eq!(over.time(&link), Duration::from_millis(26));
    let both = OverLink {
        d2h_bytes: 25_000_000,
        ..OverLink::h2d(50_000_000)
    };
    assert_eq!(both.time(&link), Duration::from_millis(2));
    assert_eq!(OverLink::default().time(&link), Duration::ZERO);
    let dead = Link {
        h2d_gbps: 0.0,
        ..link
    };
    assert_eq!(
        OverLink::h2d(1).time(&dead),
        Duration::ZERO,
        "no panic on a zero link, and no limit from it"
    );
    let other = Link {
        h2d_gbps: 40.0,
        d2h_gbps: 30.0,
        h2d_fresh_gbps: 45.0,
    };
    let best = link.best(&other);
    assert_eq!(
        (best.h2d_gbps, best.d2h_gbps, best.h2d_fresh_gbps),
        (50.0, 30.0, 45.0)
    );
}
