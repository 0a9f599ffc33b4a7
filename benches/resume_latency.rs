//! criterion bench of release/resume latency on DESIGN.md's workload (scaled to the free
//! memory; a small one on the host backend). It first prints the ratio table of
//! `gpu_pager::bench` (every figure against its limit measured in the same run), then
//! times each move with criterion.
//!
//!     cargo bench -p gpu-pager-benches --bench resume_latency
//!     GPU_PAGER_BENCH_TABLE=0 cargo bench -p gpu-pager-benches --bench resume_latency  # criterion

use std::time::{Duration, Instant};

use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};
use gpu_pager::backend::BackendKind;
use gpu_pager::{Pager, PagerConfig, Policy, RegionOptions};
use gpu_pager_tools::bench::{self, BenchConfig};

fn resume_latency(c: &mut Criterion) {
    let (backend, no_gpu) = match gpu_pager::backend::auto(0) {
        Ok(picked) => picked,
        Err(e) => panic!("resume_latency: no backend: {e}"),
    };
    if let Some(why) = &no_gpu {
        eprintln!("resume_latency: no GPU ({why}); timing the host backend");
    }
    let cfg = if backend.info().kind == BackendKind::Cuda {
        let free = backend.mem_info().map(|m| m.free).unwrap_or(0);
        BenchConfig {
            cold_release: false,
            ..BenchConfig::design()
        }
        .fit(free)
    } else {
        BenchConfig::small()
    };
    // GPU_PAGER_BENCH_TABLE=0 skips the table (it is `gpu-pager bench`'s, minutes on a GPU)
    // when only the criterion timings are wanted.
    if std::env::var("GPU_PAGER_BENCH_TABLE").as_deref() != Ok("0") {
        match bench::run(backend.clone(), &cfg, &mut |l| {
            eprintln!("resume_latency: {l}")
        }) {
            Ok(table) => println!("{table}"),
            Err(e) => panic!("resume_latency: the ratio table failed: {e}"),
        }
    }

    let pager = Pager::with_config(
        backend,
        PagerConfig {
            chunk_bytes: cfg.chunk_bytes,
            ..PagerConfig::default()
        },
    );
    let setup = || -> gpu_pager::Result<gpu_pager::Buffer> {
        pager.region_with(
            "weights",
            cfg.weights_bytes,
            Policy::Preserve,
            RegionOptions {
                prepin: true,
                ..Default::default()
            },
        )?;
        pager.region("kv_cache", cfg.kv_bytes, Policy::Discard)?;
        let w = pager.alloc("weights", cfg.weights_bytes - 4096)?;
        pager.fill(&w, 0x1234_5678)?;
        Ok(w)
    };
    let w = setup().expect("resume_latency: setting up the regions");
    let mut g = c.benchmark_group("resume_latency");
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .measurement_time(Duration::from_secs(5));

    // Times `timed` after running `untimed`, `iters` times.
    let run = |iters: u64, untimed: &dyn Fn(), timed: &dyn Fn()| {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            untimed();
            let t = Instant::now();
            timed();
            total += t.elapsed();
        }
        total
    };
    let ok = |r: gpu_pager::Result<gpu_pager::Report>| {
        r.expect("resume_latency: a move failed");
    };
    g.bench_function("resume_weights", |b| {
        b.iter_custom(|n| {
            run(n, &|| ok(pager.release(&["weights"])), &|| {
                ok(pager.resume(&["weights"]))
            })
        })
    });
    g.bench_function("release_weights_unchanged", |b| {
        b.iter_custom(|n| {
            run(n, &|| ok(pager.resume(&["weights"])), &|| {
                ok(pager.release(&["weights"]))
            })
        })
    });
    let gen_cell = std::cell::Cell::new(0u32);
    g.bench_function("release_weights_changed", |b| {
        b.iter_custom(|n| {
            run(
                n,
                &|| {
                    ok(pager.resume(&["weights"]));
                    gen_cell.set(gen_cell.get() + 1);
                    pager.fill(&w, gen_cell.get()).expect("fill");
                },
                &|| ok(pager.release(&["weights"])),
            )
        })
    });
    g.bench_function("resume_kv", |b| {
        b.iter_custom(|n| {
            run(n, &|| ok(pager.release(&["kv_cache"])), &|| {
                ok(pager.resume(&["kv_cache"]))
            })
        })
    });
    g.bench_function("release_kv", |b| {
        b.iter_custom(|n| {
            run(n, &|| ok(pager.resume(&["kv_cache"])), &|| {
                ok(pager.release(&["kv_cache"]))
            })
        })
    });
    g.finish();
}

criterion_group!(benches, resume_latency);
criterion_main!(benches);
