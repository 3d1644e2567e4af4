//! rustorch-cuda: the CUDA backend.
//!
//! The driver (`libcuda`) and the run-time compiler (`libnvrtc`) are loaded when a device
//! is opened, never at link time: this crate builds and runs on machines without CUDA, where
//! [`CudaDevice::open`] returns a [`CudaError`] naming what is missing. The kernels are CUDA C
//! files in `kernels/`, compiled by NVRTC for the device's architecture on first use and
//! cached on disk (see [`device`]).

pub mod backend;
pub mod device;
pub mod error;
pub mod kernels;
pub mod kv;
pub mod mega;
pub mod nvrtc;
pub mod probe;
pub mod step;

pub use backend::{Cuda, CudaAngles};
pub use device::{device_count, CudaDevice, DeviceInfo, GpuVec, ModuleInfo};
pub use error::CudaError;
pub use kernels::{AttnRow, AttnShape, CudaMatrix, Scratch};
pub use kv::{CudaKvStore, KeyRope};
pub use step::{CudaState, GraphStats, HostValues};

#[cfg(test)]
mod tests {
    use super::*;

    /// Where there is no driver (CI, this crate's development machine), opening a device is
    /// an error naming the driver library, not a panic. On a GPU machine it opens.
    #[test]
    fn open_without_driver_is_a_clean_error() {
        match CudaDevice::open(0) {
            Err(CudaError::DriverMissing { tried }) => {
                assert!(tried.contains("libcuda.so.1"));
                let msg = CudaError::DriverMissing { tried }.to_string();
                assert!(msg.contains("driver"), "{msg}");
            }
            Ok(dev) => {
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr(),
                    "SKIPPED: driver-missing check: a GPU is present ({})",
                    dev.info.name
                );
                // a device index past the end is a clean error too
                let n = device::device_count().unwrap_or(0);
                assert!(matches!(
                    CudaDevice::open(n),
                    Err(CudaError::BadDeviceIndex { .. })
                ));
            }
            Err(e) => {
                // a driver library exists but no usable GPU: still an error, not a panic
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "SKIPPED: driver-missing check: {e}");
            }
        }
    }
}
