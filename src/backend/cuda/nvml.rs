//! The processes on a device, through NVML (`libnvidia-ml.so.1`, which every NVIDIA driver
//! installs), for the audit and the release's warning. NVML's first initialisation takes
//! tens of milliseconds, so the CUDA backend starts it on a helper thread when it is
//! created, instead of inside the first release that warns. A machine without it, or a
//! device NVML cannot find, answers `None`.

use std::sync::OnceLock;

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;

use super::super::DeviceProcess;

/// NVML, initialized once per process (`None`: it could not be loaded or initialized).
fn nvml() -> Option<&'static Nvml> {
    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();
    NVML.get_or_init(|| Nvml::init().ok()).as_ref()
}

/// Initialises NVML on a helper thread (once per process; a failure to start the thread
/// leaves it to the first caller).
pub(super) fn load_in_background() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let _ = std::thread::Builder::new()
            .name("gpu-pager-nvml".into())
            .spawn(|| {
                nvml();
            });
    });
}

/// The compute processes on the device at `pci_bus_id` (CUDA's `cuDeviceGetPCIBusId` form,
/// which NVML reads too) with their device memory.
pub(super) fn processes(pci_bus_id: &str) -> Option<Vec<DeviceProcess>> {
    let device = nvml()?.device_by_pci_bus_id(pci_bus_id).ok()?;
    let listed = device.running_compute_processes().ok()?;
    Some(
        listed
            .into_iter()
            .map(|p| DeviceProcess {
                pid: p.pid,
                bytes: match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => usize::try_from(b).ok(),
                    UsedGpuMemory::Unavailable => None,
                },
            })
            .collect(),
    )
}
