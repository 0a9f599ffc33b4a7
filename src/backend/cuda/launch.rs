//! Every kernel the CUDA backend runs goes through here: the embedded modules, each loaded
//! into the context once (all of them at [`CudaBackend::new`]), their functions looked up by
//! [`Kernel`], and [`CudaBackend::launch`], the backend's one call of `cuLaunchKernel`.
//! The callers (fill, chunk hash, copy kernel, KV kernels) build a kernel's parameter struct
//! and its geometry and check what the kernel cannot survive; nothing else of a launch lives
//! outside this file.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaFunction, CudaModule, sys};

use super::{CudaBackend, check, driver_err};
use crate::backend::BackendResult;
use crate::kernels::{self, KernelModule, LaunchGeometry};

/// One kernel of the embedded modules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kernel {
    /// `gp_fill`, taking `abi::GpFillParams`.
    Fill,
    /// `gp_chunk_hash_partial`, taking `abi::GpChunkHashParams`.
    ChunkHashPartial,
    /// `gp_chunk_hash_finalize`, taking `abi::GpChunkHashParams`.
    ChunkHashFinalize,
    /// `gp_copy`, taking `abi::GpCopyParams`.
    Copy,
    /// `gp_kv_write`, taking `abi::GpKvRowsParams`.
    KvWrite,
    /// `gp_kv_gather`, taking `abi::GpKvRowsParams`.
    KvGather,
    /// `gp_kv_move_blocks`, taking `abi::GpKvMoveParams`.
    KvMoveBlocks,
}

impl Kernel {
    /// Every kernel, in the variants' order (the order of [`Loaded::functions`]).
    const ALL: [Kernel; 7] = [
        Kernel::Fill,
        Kernel::ChunkHashPartial,
        Kernel::ChunkHashFinalize,
        Kernel::Copy,
        Kernel::KvWrite,
        Kernel::KvGather,
        Kernel::KvMoveBlocks,
    ];

    fn module(self) -> KernelModule {
        match self {
            Kernel::Fill => KernelModule::Fill,
            Kernel::ChunkHashPartial | Kernel::ChunkHashFinalize => KernelModule::ChunkHash,
            Kernel::Copy => KernelModule::Copy,
            Kernel::KvWrite | Kernel::KvGather | Kernel::KvMoveBlocks => KernelModule::Kv,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kernel::Fill => kernels::FILL,
            Kernel::ChunkHashPartial => kernels::CHUNK_HASH_PARTIAL,
            Kernel::ChunkHashFinalize => kernels::CHUNK_HASH_FINALIZE,
            Kernel::Copy => kernels::COPY,
            Kernel::KvWrite => kernels::kv::WRITE,
            Kernel::KvGather => kernels::kv::GATHER,
            Kernel::KvMoveBlocks => kernels::kv::MOVE_BLOCKS,
        }
    }

    /// Its place in [`Kernel::ALL`] (the variants' order).
    fn index(self) -> usize {
        self as usize
    }
}

/// The modules loaded into a backend's context and the functions looked up in them, each
/// set once. Two threads may race to load one; the loser's copy is dropped.
#[derive(Debug, Default)]
pub(super) struct Loaded {
    modules: [OnceLock<Arc<CudaModule>>; KernelModule::ALL.len()],
    functions: [OnceLock<CudaFunction>; Kernel::ALL.len()],
}

impl CudaBackend {
    /// Loads every kernel module and function that is not loaded yet. [`CudaBackend::new`]
    /// does, so a backend has them all from the start (no module is loaded at a first
    /// wake-up or while a stream captures); a no-op then.
    pub fn preload_kernels(&self) -> BackendResult<()> {
        for kernel in Kernel::ALL {
            self.function(kernel)?;
        }
        Ok(())
    }

    /// Whether every kernel is loaded (from [`CudaBackend::new`] on).
    pub fn kernels_loaded(&self) -> bool {
        self.loaded.functions.iter().all(|f| f.get().is_some())
    }

    /// `kernel`'s function, loading its module on first use.
    pub(super) fn function(&self, kernel: Kernel) -> BackendResult<&CudaFunction> {
        let slot = &self.loaded.functions[kernel.index()];
        if let Some(f) = slot.get() {
            return Ok(f);
        }
        let _scope = self.dev.scope()?;
        let module = self.module(kernel.module())?;
        let function = module
            .load_function(kernel.name())
            .map_err(|e| driver_err("cuModuleGetFunction", e))?;
        Ok(slot.get_or_init(|| function))
    }

    /// `module`, loaded into the context on first use. The caller holds a
    /// [`super::CtxScope`].
    fn module(&self, module: KernelModule) -> BackendResult<&Arc<CudaModule>> {
        // Its variant's place, which is its place in `KernelModule::ALL` (a test below).
        let slot = &self.loaded.modules[module as usize];
        if let Some(m) = slot.get() {
            return Ok(m);
        }
        let loaded = self
            .dev
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(module.fatbin().to_vec()))
            .map_err(|e| driver_err("cuModuleLoadData", e))?;
        Ok(slot.get_or_init(|| loaded))
    }

    /// Launches `kernel` with its one by-value parameter struct `params` on `stream`, in
    /// `geometry`, without waiting. Loads the kernel first if it is not loaded yet (it is,
    /// from [`CudaBackend::new`] on, so that a capture never loads a module).
    ///
    /// # Safety
    /// `kernel` takes exactly one `P` by value (its variant's doc names the type); every
    /// address `params` leads to is mapped when the kernel runs, and nothing else accesses
    /// what it writes; `stream` is a live stream of this backend's context; the caller holds
    /// a [`super::CtxScope`].
    pub(super) unsafe fn launch<P>(
        &self,
        kernel: Kernel,
        geometry: LaunchGeometry,
        params: &P,
        stream: sys::CUstream,
    ) -> BackendResult<()> {
        let function = self.function(kernel)?;
        let mut args = [std::ptr::from_ref(params)
            .cast_mut()
            .cast::<std::ffi::c_void>()];
        let (g, b) = (geometry.grid, geometry.block);
        // SAFETY: the caller's contract; `args` holds one pointer to the parameter struct,
        // which the driver copies before `cuLaunchKernel` returns.
        check(unsafe {
            sys::cuLaunchKernel(
                function.cu_function(),
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                0,
                stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
        .map_err(|e| driver_err("cuLaunchKernel", e))
    }
}

#[cfg(test)]
mod tests {
    use super::Kernel;

    #[test]
    fn each_kernel_sits_at_its_index_of_all() {
        for (i, k) in Kernel::ALL.iter().enumerate() {
            assert_eq!(k.index(), i, "{k:?}");
        }
    }

    #[test]
    fn each_module_sits_at_its_index_of_all() {
        for (i, m) in crate::kernels::KernelModule::ALL.iter().enumerate() {
            assert_eq!(*m as usize, i, "{m:?}");
        }
    }
}
