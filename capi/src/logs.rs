//! gpu-pager's `log` records for C and Python: a logger, installed once per copy of the
//! library, that hands each record to a C callback (`gpu_pager_set_log_callback`) and keeps
//! the newest in a bounded queue for a binding to take on its own thread
//! ([`take_records`]; the Python extension passes them to `logging` after each call).
//!
//! The core logs rarely (a failure no call could return, a host fallback); a record can come
//! from any thread, also from inside the pager with its locks held, which is why the
//! queue exists: a binding must not run foreign code there (Python's `logging` needs the
//! GIL, which the thread holding the lock may be waiting for).

use std::collections::VecDeque;
use std::ffi::{CString, c_char, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::boundary::{call, untagged};
use crate::types::gpu_pager_code;

/// Records kept for [`take_records`] at most: the newest, older ones are dropped.
pub(crate) const QUEUED_RECORDS: usize = 256;

#[allow(non_camel_case_types)] // the C name, as the header declares it
/// A C log callback: `level` 1 (error) to 5 (trace), the record's target (`"gpu_pager"`)
/// and message, both NUL-terminated and valid only during the call, and the `user` pointer
/// given to `gpu_pager_set_log_callback`.
pub type gpu_pager_log_callback = Option<
    unsafe extern "C" fn(
        level: u32,
        target: *const c_char,
        message: *const c_char,
        user: *mut c_void,
    ),
>;

/// One record, as a binding takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    /// 1 error … 5 trace.
    pub level: u32,
    /// `"gpu_pager"`.
    pub target: String,
    /// The sentence.
    pub message: String,
    /// The record's data as name and value (the release warning's `event`, `device`,
    /// `outside_bytes`), for a binding to pass on as data; empty for most records.
    pub fields: Vec<(String, String)>,
}

/// Collects a record's key-values as text.
#[derive(Default)]
struct Fields(Vec<(String, String)>);

impl<'kvs> log::kv::VisitSource<'kvs> for Fields {
    fn visit_pair(
        &mut self,
        key: log::kv::Key<'kvs>,
        value: log::kv::Value<'kvs>,
    ) -> Result<(), log::kv::Error> {
        self.0.push((key.to_string(), value.to_string()));
        Ok(())
    }
}

struct Sink {
    callback: gpu_pager_log_callback,
    /// The C caller's pointer, passed back untouched.
    user: usize,
}

static SINK: Mutex<Sink> = Mutex::new(Sink {
    callback: None,
    user: 0,
});
static QUEUE: Mutex<VecDeque<LogRecord>> = Mutex::new(VecDeque::new());
static QUEUEING: AtomicBool = AtomicBool::new(false);

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Forward;

impl log::Log for Forward {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = record.level() as u32;
        let message = record.args().to_string();
        let sink = locked(&SINK);
        if let Some(cb) = sink.callback {
            let target = CString::new(record.target().replace('\0', " ")).unwrap_or_default();
            let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
            // SAFETY: the callback was given by the C caller for exactly this use; both
            // strings are NUL-terminated and outlive the call; `user` is its own pointer.
            unsafe {
                cb(
                    level,
                    target.as_ptr(),
                    text.as_ptr(),
                    sink.user as *mut c_void,
                )
            };
        }
        drop(sink);
        if QUEUEING.load(Ordering::Relaxed) {
            let mut q = locked(&QUEUE);
            if q.len() == QUEUED_RECORDS {
                q.pop_front();
            }
            let mut fields = Fields::default();
            // A visitor that only collects cannot fail.
            let _ = record.key_values().visit(&mut fields);
            q.push_back(LogRecord {
                level,
                target: record.target().to_owned(),
                message,
                fields: fields.0,
            });
        }
    }

    fn flush(&self) {}
}

static FORWARD: Forward = Forward;

/// Installs the forwarding logger (once) with `level` (1 error … 5 trace; 0 turns records
/// off). Fails when the process already has another logger (a Rust application's own).
fn install(level: u32) -> Result<(), String> {
    static INSTALLED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            log::set_logger(&FORWARD).map_err(|_| {
                "the process already has a logger (a Rust application's own): gpu-pager's \
                 records go to it"
                    .to_owned()
            })
        })
        .clone()?;
    // Off, Error, Warn, Info, Debug, Trace: the filter's own order is the level number.
    let filter = log::LevelFilter::iter().nth(level as usize);
    log::set_max_level(filter.unwrap_or(log::LevelFilter::Trace));
    Ok(())
}

/// Keeps records of `level` and above for [`take_records`] (a binding's own thread drains
/// them), installing the logger if needed.
pub fn queue_records(level: u32) -> Result<(), String> {
    install(level)?;
    QUEUEING.store(true, Ordering::Relaxed);
    Ok(())
}

/// The records kept since the last call, oldest first (empty without [`queue_records`]).
pub fn take_records() -> Vec<LogRecord> {
    if !QUEUEING.load(Ordering::Relaxed) {
        return Vec::new();
    }
    locked(&QUEUE).drain(..).collect()
}

/// Sends gpu-pager's log records of `level` and above (1 error, 2 warning, 3 info, 4 debug,
/// 5 trace; 0 none) to `callback` with `user`; a NULL callback stops. The callback runs on
/// the thread that logged, possibly inside a gpu-pager call holding its locks: it must
/// return quickly and must not call gpu-pager. Records are rare: a failure no call could
/// return (also counted in `gpu_pager_stats.deferred_errors`) or a fallback to host memory.
/// `GPU_PAGER_ERROR_INVALID_ARGUMENT` when the process already has another logger (a Rust
/// application's own, which then gets the records).
///
/// # Safety
/// `callback` is NULL or a function safe to call from any thread with `user` until it is
/// replaced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpu_pager_set_log_callback(
    callback: gpu_pager_log_callback,
    user: *mut c_void,
    level: u32,
) -> gpu_pager_code {
    call("gpu_pager_set_log_callback", || {
        install(level).map_err(untagged)?;
        *locked(&SINK) = Sink {
            callback,
            user: user as usize,
        };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    static SEEN: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn count(
        level: u32,
        _: *const c_char,
        message: *const c_char,
        _: *mut c_void,
    ) {
        // SAFETY: the logger passes a NUL-terminated message valid for the call.
        let text = unsafe { std::ffi::CStr::from_ptr(message) };
        if level == 2 && text.to_bytes() == b"one record" {
            SEEN.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn records_reach_the_callback_and_the_queue() {
        // SAFETY: `count` is safe from any thread; no user pointer.
        let code = unsafe { gpu_pager_set_log_callback(Some(count), std::ptr::null_mut(), 2) };
        assert_eq!(code, gpu_pager_code::GPU_PAGER_OK);
        queue_records(2).unwrap();
        log::warn!(target: "gpu_pager", "one record");
        log::info!(target: "gpu_pager", "below the level");
        assert_eq!(SEEN.load(Ordering::Relaxed), 1);
        log::warn!(target: "gpu_pager", event = "e", device = 3usize; "with data");
        let taken = take_records();
        assert!(taken.iter().any(|r| r.level == 2
            && r.target == "gpu_pager"
            && r.message == "one record"
            && r.fields.is_empty()));
        assert!(!taken.iter().any(|r| r.message == "below the level"));
        let with_data = taken.iter().find(|r| r.message == "with data").unwrap();
        assert_eq!(
            with_data.fields,
            [
                ("event".to_owned(), "e".to_owned()),
                ("device".to_owned(), "3".to_owned())
            ]
        );
        for _ in 0..QUEUED_RECORDS + 10 {
            log::error!("flood");
        }
        assert_eq!(take_records().len(), QUEUED_RECORDS, "the newest are kept");
        // SAFETY: a NULL callback.
        let code = unsafe { gpu_pager_set_log_callback(None, std::ptr::null_mut(), 2) };
        assert_eq!(code, gpu_pager_code::GPU_PAGER_OK);
        log::warn!(target: "gpu_pager", "one record");
        assert_eq!(SEEN.load(Ordering::Relaxed), 1, "stopped");
    }
}
