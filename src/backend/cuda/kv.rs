//! The paged KV cache kernels on CUDA: checking their parameters and uploading a call's
//! index lists (the launch itself is `launch.rs`'s).
//!
//! [`CudaBackend::kv_rows_on`] and [`CudaBackend::kv_move_on`] enqueue one launch from
//! ready parameter structs (index lists already in device memory), for CUDA graphs and
//! benchmarks. [`KvKernels::kv`] is the checked, synchronous path: it
//! validates the [`KvOp`], copies its index lists into device scratch memory on the kernel
//! stream, launches and waits.

use std::borrow::Cow;

use cudarc::driver::{CudaStream, sys};

use super::launch::Kernel;
use super::{CudaBackend, check, driver_err};
use crate::backend::{BackendError, BackendResult, KvKernels, RawStream, kv_invalid};
use crate::kernels::kv::{Kv, KvOp};
use crate::kernels::{abi, kv as geometry};

/// Which row kernel [`CudaBackend::kv_rows_on`] launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowsKernel {
    /// `gp_kv_write`: token-major buffers into the cache through a slot mapping.
    Write,
    /// `gp_kv_gather`: the cache, through a block table, into a token-major buffer.
    Gather,
}

fn invalid(op: &'static str, reason: String) -> BackendError {
    BackendError::Invalid { op, reason }
}

/// The access widths the kernels have code for.
fn check_vec_bytes(vec_bytes: u32) -> BackendResult<()> {
    if matches!(vec_bytes, 2 | 4 | 8 | 16) {
        Ok(())
    } else {
        Err(invalid(
            "kv",
            format!("vec_bytes {vec_bytes} is not 2, 4, 8 or 16"),
        ))
    }
}

impl CudaBackend {
    /// Enqueues `gp_kv_write` or `gp_kv_gather` with `params` on `stream` without waiting.
    /// Only enqueues work, so it may be captured into a CUDA graph (load the kernels first
    /// with [`CudaBackend::preload_kernels`]). Only what the kernel itself cannot survive is
    /// checked (access width, alignment of the index list, a zero block size, the stream's
    /// context): build `params` with [`geometry::rows_params`] after checking the call
    /// ([`KvOp::check`]).
    ///
    /// # Safety
    /// Every address `params` leads to (the index list, every row of the cache it selects,
    /// the token-major buffers) must be mapped memory of this context when the work runs,
    /// and nothing else may write it concurrently.
    pub unsafe fn kv_rows_on(
        &self,
        stream: &CudaStream,
        kernel: RowsKernel,
        params: &abi::GpKvRowsParams,
    ) -> BackendResult<()> {
        self.check_stream("kv", stream)?;
        let _scope = self.dev.scope()?;
        // SAFETY: forwarded from the caller; the stream is a live stream of this context.
        unsafe { self.enqueue_rows(stream.cu_stream(), kernel, params) }
    }

    /// Enqueues `gp_kv_move_blocks` with `params` on `stream` without waiting (see
    /// [`CudaBackend::kv_rows_on`] for graphs and checks; build `params` with
    /// [`geometry::move_params`]).
    ///
    /// # Safety
    /// The id lists and every source and destination block they select must be mapped
    /// memory of this context (or pinned host memory) when the work runs; no destination
    /// may be a source or be written twice, and nothing else may write them concurrently.
    pub unsafe fn kv_move_on(
        &self,
        stream: &CudaStream,
        params: &abi::GpKvMoveParams,
    ) -> BackendResult<()> {
        self.check_stream("kv", stream)?;
        let _scope = self.dev.scope()?;
        // SAFETY: forwarded from the caller; the stream is a live stream of this context.
        unsafe { self.enqueue_move(stream.cu_stream(), params) }
    }

    /// [`CudaBackend::kv_rows_on`] on a raw stream. The caller holds a
    /// [`CtxScope`](super::CtxScope).
    ///
    /// # Safety
    /// As `kv_rows_on`, and `stream` must be a live stream of this context.
    unsafe fn enqueue_rows(
        &self,
        stream: sys::CUstream,
        kernel: RowsKernel,
        params: &abi::GpKvRowsParams,
    ) -> BackendResult<()> {
        check_vec_bytes(params.vec_bytes)?;
        let index_align = match kernel {
            RowsKernel::Write => 8,
            RowsKernel::Gather => 4,
        };
        if params.block_size == 0
            || !params.row_bytes.is_multiple_of(params.vec_bytes)
            || !params.index.is_multiple_of(index_align)
            || !matches!(params.planes, 1 | 2)
        {
            return Err(invalid(
                "kv",
                format!(
                    "row parameters the kernel cannot use: block_size {}, row_bytes {} with \
                     vec_bytes {}, index {:#x} (needs {index_align}-byte alignment), planes {}",
                    params.block_size,
                    params.row_bytes,
                    params.vec_bytes,
                    params.index,
                    params.planes
                ),
            ));
        }
        if params.tokens == 0 {
            return Ok(());
        }
        let vecs_per_token =
            u64::from(params.kv_heads) * u64::from(params.row_bytes) / u64::from(params.vec_bytes);
        let geometry = geometry::rows_geometry(u64::from(params.tokens), vecs_per_token);
        let function = match kernel {
            RowsKernel::Write => Kernel::KvWrite,
            RowsKernel::Gather => Kernel::KvGather,
        };
        // SAFETY: both kernels take one `GpKvRowsParams` by value, which `params` is; the
        // caller guarantees every address it leads to is mapped and the stream is live.
        unsafe { self.launch(function, geometry, params, stream) }
    }

    /// [`CudaBackend::kv_move_on`] on a raw stream. The caller holds a
    /// [`CtxScope`](super::CtxScope).
    ///
    /// # Safety
    /// As `kv_move_on`, and `stream` must be a live stream of this context.
    unsafe fn enqueue_move(
        &self,
        stream: sys::CUstream,
        params: &abi::GpKvMoveParams,
    ) -> BackendResult<()> {
        check_vec_bytes(params.vec_bytes)?;
        if !params
            .block_bytes
            .is_multiple_of(u64::from(params.vec_bytes))
            || !params.src_ids.is_multiple_of(4)
            || !params.dst_ids.is_multiple_of(4)
        {
            return Err(invalid(
                "kv",
                format!(
                    "move parameters the kernel cannot use: block_bytes {} with vec_bytes {}, \
                     id lists at {:#x} / {:#x} (need 4-byte alignment)",
                    params.block_bytes, params.vec_bytes, params.src_ids, params.dst_ids
                ),
            ));
        }
        if params.count == 0 || params.block_bytes == 0 {
            return Ok(());
        }
        let geometry = geometry::move_geometry(
            u64::from(params.count),
            params.block_bytes,
            params.vec_bytes,
        );
        // SAFETY: the kernel takes one `GpKvMoveParams` by value, which `params` is; the
        // caller guarantees every address it leads to is mapped and the stream is live.
        unsafe { self.launch(Kernel::KvMoveBlocks, geometry, params, stream) }
    }

    /// Enqueues `launch` on `stream` with its index list at device address `index`.
    ///
    /// # Safety
    /// `index` holds the op's index list (as [`plan`] laid it out) when the kernel runs;
    /// the rest as [`KvKernels::kv`]; `stream` is a live stream of this
    /// context.
    unsafe fn enqueue(
        &self,
        stream: sys::CUstream,
        launch: Launch,
        index: u64,
    ) -> BackendResult<()> {
        match launch {
            Launch::Rows(kernel, params) => {
                let params = abi::GpKvRowsParams { index, ..params };
                // SAFETY: forwarded from the caller.
                unsafe { self.enqueue_rows(stream, kernel, &params) }
            }
            Launch::Move(params, ids) => {
                let (src_ids, dst_ids) = match ids {
                    MoveIds::Both(n) => (index, index + 4 * n as u64),
                    MoveIds::Source => (index, 0),
                    MoveIds::Destination => (0, index),
                };
                let params = abi::GpKvMoveParams {
                    src_ids,
                    dst_ids,
                    ..params
                };
                // SAFETY: forwarded from the caller.
                unsafe { self.enqueue_move(stream, &params) }
            }
        }
    }
}

impl KvKernels for CudaBackend {
    /// [`KvKernels::kv`]: check, upload the index lists, launch on the
    /// kernel stream, wait.
    ///
    /// # Safety
    /// As [`KvKernels::kv`].
    unsafe fn kv(&self, op: &KvOp<'_>) -> BackendResult<()> {
        let (launch, index) = plan(op)?;
        if index.is_empty() {
            return Ok(()); // no tokens, no blocks: nothing to do
        }
        let _scope = self.dev.scope()?;
        // The scratch memory is shared: hold its lock until the kernel has finished.
        let mut slot = self
            .kv_scratch
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let dev_index = self.scratch(&mut slot, index.len())?;
        let stream = self.kernel_stream.cu_stream();
        // SAFETY: `dev_index` is scratch memory of at least `index.len()` bytes that only
        // this call uses while the lock is held; `index` lives until the stream is
        // synchronised below.
        check(unsafe {
            sys::cuMemcpyHtoDAsync_v2(dev_index, index.as_ptr().cast(), index.len(), stream)
        })
        .map_err(|e| driver_err("cuMemcpyHtoDAsync", e))?;
        // SAFETY: the call was checked by `plan`; the caller guarantees that the cache blocks
        // and buffers it touches are mapped; the index list was just copied to `dev_index`
        // on the same stream, the backend's own.
        let launched = unsafe { self.enqueue(stream, launch, dev_index) };
        // Wait even after a failed launch: the upload may still be reading `index`.
        let synced = self
            .kernel_stream
            .synchronize()
            .map_err(|e| driver_err("cuStreamSynchronize", e));
        launched.and(synced)
    }

    /// [`KvKernels::kv_on`]: check, launch on the caller's stream
    /// with the index list already in device memory, return.
    ///
    /// # Safety
    /// As [`KvKernels::kv_on`].
    unsafe fn kv_on(&self, op: &KvOp<'_>, stream: RawStream, index: u64) -> BackendResult<()> {
        let (launch, list) = plan(op)?;
        if list.is_empty() {
            return Ok(());
        }
        let _scope = self.dev.scope()?;
        // SAFETY: forwarded from the caller (a live stream of this context; `index` holds
        // the list laid out as `plan` would upload it).
        unsafe { self.enqueue(stream.0 as sys::CUstream, launch, index) }
    }
}

/// Checks `op` and turns it into a launch (its index list's device address still 0) and
/// the index list the kernel reads, as bytes: a write's `tokens` int64 slots; a gather's
/// `⌈tokens / block_size⌉` uint32 block ids; copy_blocks' uint32 sources then
/// destinations; a swap's uint32 block ids.
fn plan<'o>(op: &KvOp<'o>) -> BackendResult<(Launch, Cow<'o, [u8]>)> {
    op.check().map_err(|e| kv_invalid(op, e))?;
    let bad = |reason: String| invalid(op.name(), reason);
    let c = *op.cache();
    let bpb = c.layout.bytes_per_block();
    Ok(match *op {
        KvOp::Write {
            layer,
            keys,
            values,
            tokens,
            token_stride_bytes,
            slot_mapping,
            ..
        } => {
            let io = geometry::TokenMajor {
                first: keys.addr,
                second: Some(values.addr),
                token_stride: token_stride_bytes as u64,
            };
            let p = geometry::rows_params(&c.layout, c.base, &[Kv::K, Kv::V], layer, io, 0, tokens);
            (
                Launch::Rows(RowsKernel::Write, p.map_err(bad)?),
                Cow::Borrowed(bytemuck::cast_slice(&slot_mapping[..tokens])),
            )
        }
        KvOp::Gather {
            layer,
            kv,
            block_table,
            tokens,
            out,
            ..
        } => {
            let io = geometry::TokenMajor {
                first: out.addr,
                second: None,
                token_stride: c.layout.token_bytes(),
            };
            let p = geometry::rows_params(&c.layout, c.base, &[kv], layer, io, 0, tokens);
            let used = tokens.div_ceil(c.layout.block_size() as usize);
            (
                Launch::Rows(RowsKernel::Gather, p.map_err(bad)?),
                Cow::Borrowed(bytemuck::cast_slice(&block_table[..used])),
            )
        }
        KvOp::CopyBlocks { pairs, .. } => {
            let ids: Vec<u32> = pairs
                .iter()
                .map(|p| p.0)
                .chain(pairs.iter().map(|p| p.1))
                .collect();
            let p = geometry::move_params(c.base, c.base, 0, 0, bpb, pairs.len());
            (
                Launch::Move(p.map_err(bad)?, MoveIds::Both(pairs.len())),
                Cow::Owned(bytemuck::cast_slice(&ids).to_vec()),
            )
        }
        KvOp::SwapOut { blocks, host, .. } => {
            let p = geometry::move_params(c.base, host.addr, 0, 0, bpb, blocks.len());
            (
                Launch::Move(p.map_err(bad)?, MoveIds::Source),
                Cow::Borrowed(bytemuck::cast_slice(blocks)),
            )
        }
        KvOp::SwapIn { blocks, host, .. } => {
            let p = geometry::move_params(host.addr, c.base, 0, 0, bpb, blocks.len());
            (
                Launch::Move(p.map_err(bad)?, MoveIds::Destination),
                Cow::Borrowed(bytemuck::cast_slice(blocks)),
            )
        }
    })
}

/// The launch a [`KvOp`] turns into, with its index list's address still 0.
enum Launch {
    Rows(RowsKernel, abi::GpKvRowsParams),
    Move(abi::GpKvMoveParams, MoveIds),
}

/// Which id lists of a block move the uploaded index list holds.
enum MoveIds {
    /// `n` source ids, then `n` destination ids (copy_blocks).
    Both(usize),
    /// Source ids; destinations by position (swap_out).
    Source,
    /// Destination ids; sources by position (swap_in).
    Destination,
}
