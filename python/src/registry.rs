//! One pager per device and process.
//!
//! TODO: use the core registry. Branch `capi` adds `gpu_pager::Pager::for_device` (shared
//! with the C ABI and torch's allocator hooks, so that every layer sees the same pager);
//! once it is merged, [`for_device`] becomes `gpu_pager::Pager::for_device(device)`,
//! [`host_fallback`] becomes `gpu_pager::registry::host_fallback()`, and the rest of this
//! file goes.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};

use gpu_pager::{Error, Pager};

static PAGERS: Mutex<BTreeMap<usize, Arc<Pager>>> = Mutex::new(BTreeMap::new());
static HOST_FALLBACK: OnceLock<String> = OnceLock::new();

/// The process's pager for `device`, created on first use.
pub(crate) fn for_device(device: usize) -> gpu_pager::Result<Arc<Pager>> {
    // TODO: use the core registry: `gpu_pager::Pager::for_device(device)`.
    private_for_device(device)
}

/// Why device 0 runs on the host backend, once its pager was created that way.
pub(crate) fn host_fallback() -> Option<String> {
    // TODO: use the core registry: `gpu_pager::registry::host_fallback()`.
    HOST_FALLBACK.get().cloned()
}

fn private_for_device(device: usize) -> gpu_pager::Result<Arc<Pager>> {
    let mut map = PAGERS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = map.get(&device) {
        return Ok(p.clone());
    }
    let backend: Arc<dyn gpu_pager::backend::Backend> = if device == 0 {
        // CUDA if present, else host memory (capacity from GPU_PAGER_HOST_CAPACITY).
        let (backend, why) = gpu_pager::backend::auto();
        if let Some(why) = why {
            let _ = HOST_FALLBACK.set(why);
        }
        backend
    } else {
        let cuda = gpu_pager::backend::cuda::CudaBackend::new(device)
            .map_err(|e| Error::backend("*", "opening the device", e))?;
        Arc::new(cuda)
    };
    let pager = Arc::new(Pager::new(backend));
    map.insert(device, pager.clone());
    Ok(pager)
}
