//! The device and its primary context: a scope that makes the context current for a call
//! and restores the caller's, and values that are dropped inside it.

use super::*;

/// The calling thread's current context (`NULL` when it has none).
fn current_context() -> BackendResult<sys::CUcontext> {
    let mut current: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `current` is a valid out-pointer.
    check(unsafe { sys::cuCtxGetCurrent(&mut current) })
        .map_err(|e| driver_err("cuCtxGetCurrent", e))?;
    Ok(current)
}

/// Our context made current for a scope, and the caller's given back when the scope ends
/// (PyTorch's `c10::cuda::CUDAGuard` pattern): engines call in from threads whose current
/// context may be another device's, or none, and must find it unchanged afterwards.
///
/// [`CtxScope::enter`] reads the current context (`cuCtxGetCurrent`), makes ours current only
/// if it differs, and the drop restores the previous one (`NULL` included); when ours was
/// current already the scope changes nothing and costs one `cuCtxGetCurrent`. Scopes nest.
/// The raw pointer makes the scope `!Send`, so it is dropped on the thread that entered it.
///
/// cudarc's own calls inside a scope (stream synchronisation, module loading, launches)
/// call its `bind_to_thread`, which then finds our context current and changes nothing.
#[must_use]
pub(super) struct CtxScope<'a> {
    /// The context to make current again when the scope ends; `None`: nothing to undo.
    pub(super) previous: Option<sys::CUcontext>,
    pub(super) errors: &'a DeferredErrors,
}

impl<'a> CtxScope<'a> {
    /// Makes `ctx` current until the scope drops.
    ///
    /// cudarc's `Drop` impls (streams, modules, events) record their failures in the
    /// context, and its next `bind_to_thread` returns them as the error of whatever call
    /// made it, which would fail the caller's unrelated operation. They are drained here
    /// first, into `errors` (logged, kept for [`crate::Pager::take_deferred_errors`]).
    pub(super) fn enter(ctx: &CudaContext, errors: &'a DeferredErrors) -> BackendResult<Self> {
        if let Err(e) = ctx.check_err() {
            errors.record(format!(
                "a CUDA error deferred by cudarc from an earlier release of a driver object: {}",
                describe(e)
            ));
        }
        let current = current_context()?;
        let ours = ctx.cu_ctx();
        if current == ours {
            return Ok(CtxScope {
                previous: None,
                errors,
            });
        }
        // SAFETY: `ours` is a live context: `ctx` holds it for the whole call.
        check(unsafe { sys::cuCtxSetCurrent(ours) })
            .map_err(|e| driver_err("cuCtxSetCurrent", e))?;
        Ok(CtxScope {
            previous: Some(current),
            errors,
        })
    }

    /// Saves the current context and restores it when the scope drops, whatever is made
    /// current in between: around cudarc calls that bind a context and leave it bound
    /// (`CudaContext::new`, `CudaContext`'s drop), when ours is not yet, or no longer,
    /// usable.
    pub(super) fn save(errors: &'a DeferredErrors) -> BackendResult<Self> {
        Ok(CtxScope {
            previous: Some(current_context()?),
            errors,
        })
    }
}

impl Drop for CtxScope<'_> {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: `previous` was current on this thread when the scope began (or NULL,
            // which unbinds); the scope is `!Send`, so this is the same thread, and the
            // caller's context outlives the call that entered the scope.
            if let Err(e) = check(unsafe { sys::cuCtxSetCurrent(previous) }) {
                self.errors.record(format!(
                    "giving the calling thread its CUDA context back (cuCtxSetCurrent) failed: \
                     {}",
                    describe(e)
                ));
            }
        }
    }
}

/// What the backend and every handle it hands out hold: the context, the sink for the
/// failures their `Drop` cannot return, and the [`Reclaimer`] their releases notify. The
/// context is released when the last holder drops.
pub(super) struct Dev {
    /// `ManuallyDrop` so that [`Dev`]'s drop releases it inside a scope: cudarc's
    /// `CudaContext` drop makes the context current, and leaves it so, before it releases
    /// the primary context.
    pub(super) ctx: ManuallyDrop<Arc<CudaContext>>,
    pub(super) errors: Arc<DeferredErrors>,
    pub(super) reclaim: Reclaimer,
}

impl fmt::Debug for Dev {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dev")
            .field("ordinal", &self.ctx.ordinal())
            .finish_non_exhaustive()
    }
}

impl Dev {
    /// Our context made current until the returned scope drops ([`CtxScope::enter`]).
    pub(super) fn scope(&self) -> BackendResult<CtxScope<'_>> {
        CtxScope::enter(&self.ctx, &self.errors)
    }

    /// [`Dev::scope`] inside a `Drop`: a failure is recorded, and the caller goes on with
    /// its driver call (which then fails and is recorded too, or succeeds).
    pub(super) fn scope_in_drop(&self, what: &str) -> Option<CtxScope<'_>> {
        self.scope()
            .map_err(|e| {
                self.errors
                    .record(format!("making the context current to drop {what}: {e}"))
            })
            .ok()
    }

    /// `bytes` of device memory were released just now: the reclaimer collects the driver's
    /// scrubbed pages on its helper thread ([`crate::backend::reclaim`]).
    pub(super) fn freed(self: &Arc<Self>, bytes: usize) {
        self.reclaim.freed(bytes, || {
            // Weak: the helper thread must not keep the context alive.
            let dev = Arc::downgrade(self);
            Box::new(move || match dev.upgrade() {
                Some(dev) => {
                    dev.collect_scrubbed();
                    true
                }
                None => false,
            })
        });
    }

    /// Creates and releases one minimum-granularity chunk: the allocation collects every
    /// page the driver has scrubbed since the last one, so that the next real allocation
    /// does not pay for them. Best effort: a failure is only logged.
    fn collect_scrubbed(&self) {
        let Ok(_scope) = self.scope() else {
            return;
        };
        // Relaxed, so that these calls never invalidate a graph another thread is
        // capturing in global mode.
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid in/out pointer; the call sets this thread's mode only.
        if check(unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }).is_err() {
            return;
        }
        let device = self.ctx.cu_device();
        let min = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        let Ok(size) = query_granularity(device, min) else {
            return;
        };
        let prop = device_alloc_prop(device);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` is a valid out-pointer and `prop` fully initialised.
        match check(unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) }) {
            Ok(()) => {
                // SAFETY: the handle came from cuMemCreate just above, unmapped, and is
                // released once, here.
                if let Err(e) = check(unsafe { sys::cuMemRelease(handle) }) {
                    self.record(
                        "cuMemRelease",
                        format_args!("the {size}-byte chunk that collects scrubbed memory"),
                        e,
                    );
                }
            }
            Err(e) => log::debug!(
                "collecting scrubbed device memory ahead: cuMemCreate failed: {}",
                describe(e)
            ),
        }
    }

    /// Records the failure of the driver call `op` while dropping something.
    pub(super) fn record(&self, op: &str, what: std::fmt::Arguments<'_>, e: DriverError) {
        self.errors
            .record(format!("{op} of {what} failed: {}", describe(e)));
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        let restore = CtxScope::save(&self.errors)
            .map_err(|e| {
                self.errors
                    .record(format!("reading the current context to release ours: {e}"))
            })
            .ok();
        if let Err(e) = self.ctx.check_err() {
            self.errors.record(format!(
                "a CUDA error deferred by cudarc from an earlier release of a driver object: {}",
                describe(e)
            ));
        }
        // SAFETY: `ctx` is taken exactly once, here, and `self` is never used again.
        let ctx = unsafe { ManuallyDrop::take(&mut self.ctx) };
        drop(ctx);
        drop(restore);
    }
}

/// A cudarc object whose `Drop` makes its context current and leaves it so (a stream; a
/// module, which every `CudaFunction` holds). Dropping it here does so inside a
/// [`CtxScope`], so the thread that drops the backend keeps its context.
pub(super) struct InScope<T> {
    pub(super) value: ManuallyDrop<T>,
    pub(super) dev: Arc<Dev>,
}

impl<T> InScope<T> {
    pub(super) fn new(value: T, dev: &Arc<Dev>) -> Self {
        InScope {
            value: ManuallyDrop::new(value),
            dev: dev.clone(),
        }
    }
}

impl<T> std::ops::Deref for InScope<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> Drop for InScope<T> {
    fn drop(&mut self) {
        let scope = self.dev.scope_in_drop("a CUDA stream or module");
        // SAFETY: `value` is dropped exactly once, here, and never used again.
        unsafe { ManuallyDrop::drop(&mut self.value) };
        drop(scope);
    }
}
