//! The crate's integration tests, one binary (one link instead of one per file): host tests
//! run anywhere on the host backend; tests named `gpu_*` are `#[ignore = "needs a CUDA GPU"]`
//! and run on a GPU machine with `cargo test -- --ignored`.

mod common;

mod buffer_at;
mod design_tree;
mod error_codes;
mod gpu_backend;
mod gpu_growing;
mod gpu_kv;
mod gpu_overwritten;
mod gpu_pager;
mod gpu_pinned;
mod gpu_pump;
mod growing_model;
mod host_audit;
mod host_backup_files;
mod host_backup_read;
mod host_buffers_and_errors;
mod host_companions;
mod host_discard_chunks;
mod host_driver_floor;
mod host_drop_model;
mod host_elastic;
mod host_errors;
mod host_fault_model;
mod host_fault_threads;
mod host_faulty;
mod host_first_save;
mod host_first_save_growing;
mod host_fork;
mod host_growing;
mod host_liveness;
mod host_media;
mod host_model;
mod host_overwritten;
mod host_pager;
mod host_pin_batch;
mod host_poison;
mod host_pump;
mod kv_block_pool;
mod kv_cache_model;
mod kv_kernels;
mod kv_reference;
mod layers;
mod registry;
