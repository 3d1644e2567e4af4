//! What opening a device or running a kernel can fail with.

/// Why the CUDA backend cannot run, or what went wrong while it ran.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The NVIDIA driver library (`libcuda.so.1`) could not be loaded: no NVIDIA driver is
    /// installed, or it is not on the library search path.
    #[error("CUDA driver library not found (tried {tried}): no NVIDIA driver is installed or it is not on the library path")]
    DriverMissing { tried: String },
    /// The driver loaded but `cuInit` failed (e.g. a driver/kernel-module mismatch).
    #[error("CUDA driver failed to initialize: {0}")]
    DriverInit(String),
    /// The driver works but reports no GPU.
    #[error("no CUDA device found (the driver reports none)")]
    NoDevice,
    /// A device index beyond the devices present.
    #[error("CUDA device {index} does not exist ({count} device(s) present: 0..{count})")]
    BadDeviceIndex { index: usize, count: usize },
    /// The run-time compiler library (`libnvrtc.so`) could not be loaded.
    #[error("NVRTC library not found (tried {tried}); install the CUDA toolkit's NVRTC (e.g. the nvidia-cuda-nvrtc package) or set RUSTORCH_NVRTC to the path of libnvrtc.so")]
    NvrtcMissing { tried: String },
    /// The kernels did not compile (the compiler's log is included).
    #[error("compiling the CUDA kernels for {arch} failed: {log}")]
    Compile { arch: String, log: String },
    /// A driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(String),
    /// An operation was asked for something the kernels do not support.
    #[error("unsupported by the CUDA backend: {0}")]
    Unsupported(String),
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}

pub type Result<T, E = CudaError> = std::result::Result<T, E>;
