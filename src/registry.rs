//! One pager per device in a process, shared by every layer that embeds gpu-pager (Rust,
//! the C ABI, PyTorch's allocator hooks, Python).
//!
//! [`Pager::for_device`] creates the device's pager on first use, from any thread, and
//! returns the same [`Arc`] afterwards. Each device has its own pager: its own backend,
//! regions and streams. Pagers live until the process exits.
//!
//! [`Pager::configure`] chooses a device's settings ([`PagerConfig`]) before its pager is
//! created; without it the pager has the default settings.
//!
//! Without a usable GPU (no driver, no device), device 0 gets the host backend, as
//! [`crate::backend::auto`] does; [`Pager::backend_kind`] says so and [`host_fallback`]
//! says why. Other devices are then an error. The host backend's capacity is half the
//! machine's memory (at most 32 GiB) unless the environment variable [`HOST_CAPACITY_ENV`] (`GPU_PAGER_HOST_CAPACITY`) says
//! otherwise, read when device 0's pager is created: a byte count, optionally with a
//! binary suffix (`268435456`, `256M`, `256MiB`, `4G`). CI uses it to run out-of-memory
//! paths with small regions.
//!
//! ```
//! use gpu_pager::Pager;
//! use gpu_pager::backend::BackendKind;
//! let pager = Pager::for_device(0)?;
//! assert!(std::sync::Arc::ptr_eq(&pager, &Pager::for_device(0)?));
//! if pager.backend_kind() == BackendKind::Host {
//!     println!("no GPU: {}", gpu_pager::registry::host_fallback().unwrap_or_default());
//! }
//! # Ok::<(), gpu_pager::Error>(())
//! ```

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock, RwLock};

use crate::backend::{Backend, BackendError};
use crate::error::{Error, Result};
use crate::pager::{Pager, PagerConfig};

/// The environment variable that sets the host backend's capacity in bytes (see the
/// module docs for the accepted forms): [`crate::backend::host::CAPACITY_ENV`].
pub use crate::backend::host::CAPACITY_ENV as HOST_CAPACITY_ENV;

static PAGERS: RwLock<BTreeMap<usize, Arc<Pager>>> = RwLock::new(BTreeMap::new());
static HOST_FALLBACK: OnceLock<String> = OnceLock::new();
/// Settings chosen for devices whose pager does not exist yet; read (under `PAGERS`'s write
/// lock) when it is created.
static CONFIGS: RwLock<BTreeMap<usize, PagerConfig>> = RwLock::new(BTreeMap::new());

impl Pager {
    /// The process's pager for device `ordinal`, created on first use (see
    /// [`crate::registry`]). Fails without creating anything when the device cannot be
    /// opened, or when [`HOST_CAPACITY_ENV`] is malformed; a later call tries again.
    pub fn for_device(ordinal: usize) -> Result<Arc<Pager>> {
        for_device(ordinal)
    }

    /// Chooses the settings of device `ordinal`'s pager, before its first use: the pager
    /// [`Pager::for_device`] creates then has them. A later call replaces them until the
    /// pager exists. Once it exists, the same settings (as the pager rounds them) are
    /// accepted and anything else is [`Error::InvalidArgument`]: a live pager's regions were
    /// made under its settings.
    pub fn configure(ordinal: usize, config: PagerConfig) -> Result<()> {
        configure(ordinal, config)
    }
}

/// Same as [`Pager::configure`].
pub fn configure(ordinal: usize, config: PagerConfig) -> Result<()> {
    if config.chunk_bytes == 0 {
        return Err(Error::invalid(
            None,
            "chunk_bytes = 0 is no chunk size: give one in bytes (rounded up to the device's \
             granularity and to a power of two, e.g. 64M), or leave it out for the default \
             (512 MiB)",
        ));
    }
    // Under the pagers' write lock, so a pager created concurrently sees either no settings
    // or these, and this call sees that pager.
    let map = PAGERS.write().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = map.get(&ordinal) {
        let effective = config.with_env()?.effective(p.backend().info().granularity);
        if effective == p.config() {
            return Ok(());
        }
        return Err(Error::InvalidArgument {
            tag: None,
            reason: format!(
                "device {ordinal}'s pager already exists with other settings ({}); settings \
                 apply when the pager is created, so configure the device before its first use \
                 (the first region, allocation or query on it), once per process",
                p.config()
            ),
        });
    }
    CONFIGS
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .insert(ordinal, config);
    Ok(())
}

/// Same as [`Pager::for_device`].
pub fn for_device(ordinal: usize) -> Result<Arc<Pager>> {
    if let Some(p) = PAGERS
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(&ordinal)
    {
        return Ok(p.clone());
    }
    // Created under the write lock, so two threads' first calls get the same pager. Opening
    // a device takes a fraction of a second, once per device and process.
    let mut map = PAGERS.write().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = map.get(&ordinal) {
        return Ok(p.clone());
    }
    let config = CONFIGS
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(&ordinal)
        .copied()
        .unwrap_or_default()
        .with_env()?;
    let pager = Arc::new(Pager::with_config(open(ordinal)?, config));
    map.insert(ordinal, pager.clone());
    Ok(pager)
}

/// The pagers created so far, by device ordinal (not creating any).
pub fn pagers() -> Vec<(usize, Arc<Pager>)> {
    PAGERS
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(d, p)| (*d, p.clone()))
        .collect()
}

/// Why device 0 runs on the host backend (the CUDA backend's error), once its pager was
/// created that way; `None` before, or when it runs on a GPU.
pub fn host_fallback() -> Option<String> {
    HOST_FALLBACK.get().cloned()
}

/// [`crate::backend::auto`] with the crate's errors: a malformed [`HOST_CAPACITY_ENV`] is
/// [`Error::InvalidArgument`], anything else [`Error::Backend`]. What the registry's pagers
/// and the `gpu-pager` program open.
pub fn open_backend(ordinal: usize) -> Result<(Arc<dyn Backend>, Option<String>)> {
    crate::backend::auto(ordinal).map_err(|e| match e {
        e @ BackendError::Invalid { .. } => Error::invalid(None, format!("{e}, or unset it")),
        e => Error::backend_of(&[], "opening the CUDA device", e),
    })
}

fn open(ordinal: usize) -> Result<Arc<dyn Backend>> {
    let (backend, why) = open_backend(ordinal)?;
    if let Some(why) = why {
        log::warn!(
            "gpu-pager: no usable GPU ({why}); device 0 runs on the host backend with {} bytes",
            backend.info().total_bytes
        );
        let _ = HOST_FALLBACK.set(why);
    }
    Ok(backend)
}
