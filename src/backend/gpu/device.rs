//! Finding and opening a GPU: which wgpu backends to try (`--gpu-backend`, else
//! `WGPU_BACKEND`, else all), ranking adapters, listing them for `picchio devices`, and
//! opening a device whose failures (validation, out of memory, device lost) are collected
//! instead of panicking, so that they surface as `Error::Backend`.

use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// A graphics API wgpu can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum GpuApi {
    /// Vulkan (Linux, Windows, Android; Mesa's lavapipe in CI).
    Vulkan,
    /// Metal (macOS, iOS).
    Metal,
    /// Direct3D 12 (Windows).
    Dx12,
    /// OpenGL / OpenGL ES (compute shaders needed).
    Gl,
}

impl GpuApi {
    /// The wgpu backend set of this API.
    pub fn backends(self) -> wgpu::Backends {
        match self {
            GpuApi::Vulkan => wgpu::Backends::VULKAN,
            GpuApi::Metal => wgpu::Backends::METAL,
            GpuApi::Dx12 => wgpu::Backends::DX12,
            GpuApi::Gl => wgpu::Backends::GL,
        }
    }
}

/// The backends to try: the `--gpu-backend` choice, else `WGPU_BACKEND` (e.g. `vulkan`),
/// else every backend this build has.
pub fn backends(api: Option<GpuApi>) -> wgpu::Backends {
    match api {
        Some(a) => a.backends(),
        None => wgpu::Backends::from_env().unwrap_or(wgpu::Backends::all()),
    }
}

fn instance(backends: wgpu::Backends) -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = backends;
    desc.flags = wgpu::InstanceFlags::from_build_config().with_env();
    wgpu::Instance::new(desc)
}

/// What Picchio needs to know about an adapter (and what `picchio devices` prints).
#[derive(Clone, Debug)]
pub struct AdapterReport {
    /// Adapter name, e.g. `llvmpipe (LLVM 15.0.6, 256 bits)`.
    pub name: String,
    /// wgpu backend (Vulkan, Metal, Dx12, Gl).
    pub backend: wgpu::Backend,
    /// Discrete, integrated, virtual, CPU (a software device such as lavapipe) or other.
    pub device_type: wgpu::DeviceType,
    /// Driver name and version.
    pub driver: String,
    /// PCI vendor and device IDs.
    pub vendor_device: (u32, u32),
    /// Memory for this adapter's buffers, in bytes, where the API reports it: the largest
    /// device-local heap on Vulkan, `recommendedMaxWorkingSetSize` on Metal (macOS), the DXGI
    /// budget of the local memory segment on DX12; `None` on GL (and Metal elsewhere).
    pub device_memory: Option<u64>,
    /// The adapter's memory is the system's RAM (Apple silicon, integrated GPUs, software
    /// adapters): what it holds comes out of the same memory as the RAM tier's experts.
    /// wgpu reports such adapters as integrated (Metal: `hasUnifiedMemory`; DX12: a UMA
    /// architecture) or CPU-type.
    pub unified_memory: bool,
    /// The adapter's limits.
    pub limits: wgpu::Limits,
    /// SHADER_F16 present.
    pub shader_f16: bool,
    /// SUBGROUP present.
    pub subgroup: bool,
    /// TIMESTAMP_QUERY present (GPU-side timing for `picchio bench-gpu`).
    pub timestamps: bool,
    /// Shaders may use `pack2x16float` / `unpack2x16float` (wgpu's downlevel flag
    /// SHADER_F16_IN_F32): what an F16 key/value cache needs. Core WGSL, and present on
    /// Metal, DX12, GL and Vulkan, except Mesa's llvmpipe (lavapipe) without SHADER_F16.
    pub f16_in_f32: bool,
}

impl AdapterReport {
    fn of(adapter: &wgpu::Adapter) -> Self {
        let info = adapter.get_info();
        let features = adapter.features();
        AdapterReport {
            name: info.name.clone(),
            backend: info.backend,
            device_type: info.device_type,
            driver: format!("{} {}", info.driver, info.driver_info).trim().to_string(),
            vendor_device: (info.vendor, info.device),
            device_memory: device_memory(adapter),
            unified_memory: matches!(
                info.device_type,
                wgpu::DeviceType::IntegratedGpu | wgpu::DeviceType::Cpu
            ),
            limits: adapter.limits(),
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            subgroup: features.contains(wgpu::Features::SUBGROUP),
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            f16_in_f32: adapter
                .get_downlevel_capabilities()
                .flags
                .contains(wgpu::DownlevelFlags::SHADER_F16_IN_F32),
        }
    }

    /// True for software devices (the adapter reports itself as a CPU).
    pub fn is_software(&self) -> bool {
        self.device_type == wgpu::DeviceType::Cpu
    }

    /// Where [`AdapterReport::device_memory`] came from, for `picchio devices`.
    pub fn memory_source(&self) -> &'static str {
        match self.backend {
            wgpu::Backend::Vulkan => "largest device-local Vulkan heap",
            wgpu::Backend::Metal => "Metal recommendedMaxWorkingSetSize",
            wgpu::Backend::Dx12 => "DXGI budget of the local segment",
            _ => "not reported by this API",
        }
    }

    /// One line: name, backend, type.
    pub fn summary(&self) -> String {
        format!("{} ({:?}, {:?})", self.name, self.backend, self.device_type)
    }
}

/// The memory an adapter's buffers may take ([`AdapterReport::device_memory`]), from
/// whichever API it runs on; `None` where the API has no such query (GL) or the query fails.
fn device_memory(adapter: &wgpu::Adapter) -> Option<u64> {
    match adapter.get_info().backend {
        wgpu::Backend::Vulkan => vulkan_memory(adapter),
        wgpu::Backend::Metal => metal_memory(adapter),
        wgpu::Backend::Dx12 => dx12_memory(adapter),
        _ => None,
    }
}

/// Device-local memory of a Vulkan adapter (the largest DEVICE_LOCAL heap).
#[cfg(not(any(target_arch = "wasm32", target_vendor = "apple")))]
fn vulkan_memory(adapter: &wgpu::Adapter) -> Option<u64> {
    // SAFETY: the hal adapter is only used to read the physical device's memory properties
    // while the guard keeps the adapter alive; nothing is created or destroyed.
    unsafe {
        let hal = adapter.as_hal::<wgpu::hal::api::Vulkan>()?;
        let props = hal
            .shared_instance()
            .raw_instance()
            .get_physical_device_memory_properties(hal.raw_physical_device());
        let count = (props.memory_heap_count as usize).min(props.memory_heaps.len());
        // Bit 0 of the heap flags is VK_MEMORY_HEAP_DEVICE_LOCAL_BIT.
        props.memory_heaps[..count].iter().filter(|h| h.flags.as_raw() & 1 != 0).map(|h| h.size).max()
    }
}

#[cfg(any(target_arch = "wasm32", target_vendor = "apple"))]
fn vulkan_memory(_adapter: &wgpu::Adapter) -> Option<u64> {
    None
}

/// Metal's `recommendedMaxWorkingSetSize`: how much the device can allocate without
/// affecting its performance (on Apple silicon a share of the system's RAM). macOS only: iOS
/// has it from version 16 on, and Picchio does not target iOS.
#[cfg(target_os = "macos")]
fn metal_memory(adapter: &wgpu::Adapter) -> Option<u64> {
    use objc2_metal::MTLDevice;
    // SAFETY: the hal adapter is only used to read one property of its MTLDevice while the
    // guard keeps the adapter alive; nothing is created or destroyed.
    let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Metal>() }?;
    let bytes = hal.raw_device().recommendedMaxWorkingSetSize();
    (bytes > 0).then_some(bytes)
}

#[cfg(not(target_os = "macos"))]
fn metal_memory(_adapter: &wgpu::Adapter) -> Option<u64> {
    None
}

/// The DXGI budget of a DX12 adapter's local memory segment (`QueryVideoMemoryInfo`): what
/// the OS lets this process use of the adapter's own memory (shared memory on UMA adapters).
#[cfg(windows)]
fn dx12_memory(adapter: &wgpu::Adapter) -> Option<u64> {
    use windows::Win32::Graphics::Dxgi::DXGI_MEMORY_SEGMENT_GROUP_LOCAL;
    // SAFETY: the hal adapter is only used to query its DXGI adapter's memory information
    // while the guard keeps the adapter alive; nothing is created or destroyed.
    let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Dx12>() }?;
    let info = hal.raw_adapter().query_video_memory_info(DXGI_MEMORY_SEGMENT_GROUP_LOCAL).ok()?;
    (info.Budget > 0).then_some(info.Budget)
}

#[cfg(not(windows))]
fn dx12_memory(_adapter: &wgpu::Adapter) -> Option<u64> {
    None
}

/// Every adapter of the chosen backends, best first.
pub fn list_adapters(api: Option<GpuApi>) -> Vec<AdapterReport> {
    ranked(&instance(backends(api)), backends(api)).iter().map(AdapterReport::of).collect()
}

fn rank(adapter: &wgpu::Adapter) -> (u8, u8) {
    let info = adapter.get_info();
    let ty = match info.device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    };
    let api = match info.backend {
        wgpu::Backend::Vulkan | wgpu::Backend::Metal | wgpu::Backend::Dx12 => 0,
        _ => 1,
    };
    (ty, api)
}

fn ranked(instance: &wgpu::Instance, backends: wgpu::Backends) -> Vec<wgpu::Adapter> {
    let mut adapters = pollster::block_on(instance.enumerate_adapters(backends));
    adapters.retain(|a| a.get_downlevel_capabilities().flags.contains(wgpu::DownlevelFlags::COMPUTE_SHADERS));
    adapters.sort_by_key(rank);
    adapters
}

/// Faults reported by the device outside any call's control (validation errors, out of
/// memory, device lost), collected so the next synchronization point can return them.
#[derive(Clone, Default)]
pub struct Faults(Arc<Mutex<Vec<String>>>);

impl Faults {
    fn push(&self, message: String) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(message);
    }

    /// `Err(Error::Backend)` with every fault so far, if any (and forgets them).
    pub fn check(&self) -> Result<()> {
        let mut faults = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if faults.is_empty() {
            return Ok(());
        }
        let all = faults.drain(..).collect::<Vec<_>>().join("; ");
        Err(Error::Backend(format!("GPU device error: {all}")))
    }
}

/// An opened device.
pub struct OpenDevice {
    /// The device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// The adapter it was opened on.
    pub report: AdapterReport,
    /// SHADER_F16 enabled on the device.
    pub shader_f16: bool,
    /// SUBGROUP enabled on the device.
    pub subgroup: bool,
    /// TIMESTAMP_QUERY enabled on the device.
    pub timestamps: bool,
    /// Where asynchronous device errors land.
    pub faults: Faults,
}

/// Which optional features Picchio may use where the adapter has them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeatureUse {
    /// Use SHADER_F16 (f16 scale loads) if present.
    pub shader_f16: bool,
    /// Use SUBGROUP (subgroup reductions) if present.
    pub subgroup: bool,
}

impl Default for FeatureUse {
    fn default() -> Self {
        FeatureUse { shader_f16: true, subgroup: true }
    }
}

/// Opens the best adapter as [`open`] does, also enabling TIMESTAMP_QUERY where the
/// adapter has it and `timestamps` asks for it (benchmarks time kernels with it).
pub fn open_timed(
    api: Option<GpuApi>,
    allow_software: bool,
    use_features: FeatureUse,
    timestamps: bool,
) -> Result<OpenDevice> {
    open_with(api, allow_software, use_features, timestamps)
}

/// Opens the best adapter of the chosen backends. Software adapters (CPU type, e.g.
/// lavapipe) are taken only with `allow_software`. The error says why no device opened.
pub fn open(api: Option<GpuApi>, allow_software: bool, use_features: FeatureUse) -> Result<OpenDevice> {
    open_with(api, allow_software, use_features, false)
}

fn open_with(
    api: Option<GpuApi>,
    allow_software: bool,
    use_features: FeatureUse,
    want_timestamps: bool,
) -> Result<OpenDevice> {
    let set = backends(api);
    let instance = instance(set);
    let adapters = ranked(&instance, set);
    let names = || adapters.iter().map(|a| AdapterReport::of(a).summary()).collect::<Vec<_>>().join(", ");
    let adapter =
        match adapters.iter().find(|a| allow_software || a.get_info().device_type != wgpu::DeviceType::Cpu) {
            Some(a) => a,
            None if adapters.is_empty() => {
                return Err(Error::Backend(format!(
                    "no GPU adapter with compute shaders among backends {set:?}"
                )));
            }
            None => {
                return Err(Error::Backend(format!(
                    "only software GPU adapters found ({}); use --device gpu to run on one anyway",
                    names()
                )));
            }
        };
    let report = AdapterReport::of(adapter);
    let mut features = wgpu::Features::empty();
    let shader_f16 = use_features.shader_f16 && report.shader_f16;
    let subgroup = use_features.subgroup && report.subgroup;
    if shader_f16 {
        features |= wgpu::Features::SHADER_F16;
    }
    if subgroup {
        features |= wgpu::Features::SUBGROUP;
    }
    let timestamps = want_timestamps && report.timestamps;
    if timestamps {
        features |= wgpu::Features::TIMESTAMP_QUERY;
    }
    let desc = wgpu::DeviceDescriptor {
        label: Some("picchio"),
        required_features: features,
        required_limits: adapter.limits(),
        ..Default::default()
    };
    let (device, queue) = pollster::block_on(adapter.request_device(&desc))
        .map_err(|e| Error::Backend(format!("opening {}: {e}", report.summary())))?;
    let faults = Faults::default();
    let f = faults.clone();
    device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| f.push(e.to_string())));
    let f = faults.clone();
    device.set_device_lost_callback(move |reason, message| {
        f.push(format!("device lost ({reason:?}): {message}"))
    });
    Ok(OpenDevice { device, queue, report, shader_f16, subgroup, timestamps, faults })
}
