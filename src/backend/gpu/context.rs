//! The device as the backend uses it: buffers, kernels, and recording.
//!
//! Ops are recorded as compute dispatches into one pending command encoder; nothing runs
//! until a readback (or a full parameter ring) submits it. Each dispatch's small uniform
//! parameters go into a host-side ring that is written to one uniform buffer right before
//! the submission and selected with a dynamic offset, and small host uploads (embedding
//! rows) go through a staging arena copied inside the encoder, so neither can overtake
//! recorded work. Bind groups are cached by the buffers they bind, so the steady state
//! creates none. Readbacks are the only waits; they are counted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};

use super::device::{Faults, OpenDevice};
use super::params::KernelParams;
use super::shaders::{Access, Op, Variant, source};

/// Bytes reserved per dispatch in the parameter ring (the usual uniform offset alignment):
/// every parameter struct ([`super::params`]) fits one.
pub const PARAM_SLOT: u64 = 256;
/// Alignment used for storage binding offsets (at least every adapter's minimum).
pub const STORAGE_ALIGN: u64 = 256;
/// Dispatches recorded before the pending work is submitted without waiting: a few layers'
/// worth, so the device starts on a token's first layers while the host records the rest.
pub const SUBMIT_EVERY: u32 = 48;
/// How long a readback may wait for the device before it counts as hung.
const POLL_TIMEOUT: Duration = Duration::from_secs(600);

/// A device buffer with an identity (for bind group caching).
#[derive(Clone, Debug)]
pub struct GBuf {
    /// The buffer.
    pub buf: wgpu::Buffer,
    /// Unique within the device.
    pub id: u64,
    /// Size in bytes.
    pub size: u64,
}

/// Counters of what the device was asked to do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCounters {
    /// Command submissions.
    pub submissions: u64,
    /// Compute dispatches recorded.
    pub dispatches: u64,
    /// Readbacks (each one waits for the device).
    pub readbacks: u64,
    /// Bytes read back.
    pub readback_bytes: u64,
    /// Bytes written from the host (weights, experts, staged rows).
    pub upload_bytes: u64,
    /// Buffers created (constant in the steady state: activations are pooled).
    pub buffers: u64,
}

struct Kernel {
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct BindKey {
    op: Op,
    variant: Variant,
    buffers: Vec<(u64, u64, u64)>,
}

/// A buffer range for a binding.
#[derive(Clone, Copy)]
pub struct Bind<'a> {
    buf: &'a GBuf,
    offset: u64,
    size: u64,
}

impl<'a> Bind<'a> {
    /// The whole buffer.
    pub fn whole(buf: &'a GBuf) -> Self {
        Bind { buf, offset: 0, size: buf.size }
    }

    /// `size` bytes from `offset` (a multiple of [`STORAGE_ALIGN`]).
    pub fn range(buf: &'a GBuf, offset: u64, size: u64) -> Self {
        Bind { buf, offset, size: size.max(4).min(buf.size - offset) }
    }

    /// The first `bytes` bytes of the buffer (at least one word).
    pub fn first(buf: &'a GBuf, bytes: u64) -> Self {
        Bind { buf, offset: 0, size: bytes.max(4).min(buf.size) }
    }
}

/// The device, its kernels and the work being recorded.
pub struct Gpu {
    /// The device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// Where the device was opened.
    pub open: OpenDeviceInfo,
    /// The largest storage binding this backend uses (the adapter's, or lower for tests).
    pub max_binding: u64,
    /// The largest buffer the device allows.
    pub max_buffer: u64,
    /// The most workgroups per grid dimension.
    pub max_groups: u32,
    /// Storage buffers one kernel may bind.
    pub max_storage_bindings: u32,
    faults: Faults,
    next_id: u64,
    kernels: HashMap<(Op, Variant), Kernel>,
    binds: HashMap<BindKey, wgpu::BindGroup>,
    encoder: Option<wgpu::CommandEncoder>,
    pass: Option<wgpu::ComputePass<'static>>,
    params: Vec<u8>,
    params_buf: GBuf,
    uploads: Vec<u8>,
    upload_buf: GBuf,
    staging: Option<GBuf>,
    /// Dispatches recorded since the last submission.
    since_submit: u32,
    /// A small buffer bound where a kernel's optional input is absent.
    pub dummy: GBuf,
    counters: DeviceCounters,
}

/// What was opened (copied out of [`OpenDevice`]).
#[derive(Clone, Debug)]
pub struct OpenDeviceInfo {
    /// The adapter.
    pub report: super::device::AdapterReport,
    /// SHADER_F16 in use.
    pub shader_f16: bool,
    /// SUBGROUP in use.
    pub subgroup: bool,
    /// TIMESTAMP_QUERY enabled.
    pub timestamps: bool,
}

fn backend_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Backend(format!("{what}: {e}"))
}

impl Gpu {
    /// Wraps an opened device. `max_binding` lowers the storage binding limit (tests).
    pub fn new(open: OpenDevice, max_binding: Option<u64>, ring_slots: usize) -> Result<Self> {
        let OpenDevice { device, queue, report, shader_f16, subgroup, timestamps, faults } = open;
        let limits = device.limits();
        let max_binding_bytes =
            binding_limit(limits.max_storage_buffer_binding_size, limits.max_buffer_size, max_binding);
        let align = limits.min_uniform_buffer_offset_alignment as u64;
        if align > PARAM_SLOT {
            return Err(Error::Backend(format!(
                "uniform offset alignment {align} exceeds {PARAM_SLOT} bytes"
            )));
        }
        let mut gpu = Gpu {
            params_buf: GBuf { buf: dummy_buffer(&device), id: 0, size: 0 },
            upload_buf: GBuf { buf: dummy_buffer(&device), id: 0, size: 0 },
            dummy: GBuf { buf: dummy_buffer(&device), id: 0, size: 0 },
            device,
            queue,
            open: OpenDeviceInfo { report, shader_f16, subgroup, timestamps },
            max_binding: max_binding_bytes,
            max_buffer: limits.max_buffer_size,
            max_groups: limits.max_compute_workgroups_per_dimension,
            max_storage_bindings: limits.max_storage_buffers_per_shader_stage,
            faults,
            next_id: 1,
            kernels: HashMap::new(),
            binds: HashMap::new(),
            encoder: None,
            pass: None,
            params: Vec::new(),
            uploads: Vec::new(),
            staging: None,
            since_submit: 0,
            counters: DeviceCounters::default(),
        };
        let ring = (ring_slots.max(64) as u64) * PARAM_SLOT;
        gpu.params_buf =
            gpu.buffer("params", ring, wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST)?;
        gpu.upload_buf =
            gpu.buffer("uploads", 1 << 20, wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST)?;
        gpu.dummy = gpu.buffer("dummy", 256, wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST)?;
        Ok(gpu)
    }

    /// Counters so far.
    pub fn counters(&self) -> DeviceCounters {
        self.counters
    }

    /// Errors the device reported asynchronously, if any.
    pub fn check(&self) -> Result<()> {
        self.faults.check()
    }

    fn scoped<T>(&self, what: &str, f: impl FnOnce() -> T) -> Result<T> {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let value = f();
        let v = pollster::block_on(validation.pop());
        let o = pollster::block_on(oom.pop());
        if let Some(e) = o.or(v) {
            return Err(backend_err(what, e));
        }
        Ok(value)
    }

    /// A new buffer of `size` bytes (rounded up to whole words).
    pub fn buffer(&mut self, label: &str, size: u64, usage: wgpu::BufferUsages) -> Result<GBuf> {
        let size = size.max(4).next_multiple_of(4);
        if size > self.max_buffer {
            return Err(Error::Backend(format!(
                "{label}: a buffer of {size} bytes exceeds the device's max_buffer_size {}",
                self.max_buffer
            )));
        }
        let buf = self.scoped(&format!("allocating {label} ({size} bytes)"), || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage,
                mapped_at_creation: false,
            })
        })?;
        self.next_id += 1;
        self.counters.buffers += 1;
        Ok(GBuf { buf, id: self.next_id, size })
    }

    /// A new storage buffer holding `bytes` (zero-padded to whole words).
    pub fn buffer_init(&mut self, label: &str, bytes: &[u8]) -> Result<GBuf> {
        let size = (bytes.len() as u64).max(4).next_multiple_of(4);
        if size > self.max_buffer {
            return Err(Error::Backend(format!(
                "{label}: a buffer of {size} bytes exceeds the device's max_buffer_size {}",
                self.max_buffer
            )));
        }
        let what = format!("allocating {label} ({size} bytes)");
        let buf = self.scoped(&what, || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: true,
            })
        })?;
        if !bytes.is_empty() {
            let mut view = buf.slice(..).get_mapped_range_mut().map_err(|e| backend_err(&what, e))?;
            view.slice(..bytes.len()).copy_from_slice(bytes);
        }
        buf.unmap();
        self.counters.upload_bytes += size;
        self.counters.buffers += 1;
        self.next_id += 1;
        Ok(GBuf { buf, id: self.next_id, size })
    }

    /// Writes `bytes` into `dst` at `offset`, after all work recorded so far: a queue write
    /// lands before the next submission, so recorded work that may read `dst` is submitted
    /// first.
    pub fn write(&mut self, dst: &GBuf, offset: u64, bytes: &[u8]) -> Result<()> {
        if self.encoder.is_some() {
            self.flush()?;
        }
        self.queue.write_buffer(&dst.buf, offset, bytes);
        self.counters.upload_bytes += bytes.len() as u64;
        Ok(())
    }

    /// Counts `bytes` written to the device by another thread (the VRAM promoter's writes).
    pub fn count_upload(&mut self, bytes: u64) {
        self.counters.upload_bytes += bytes;
    }

    fn kernel(&mut self, op: Op, variant: Variant) -> Result<&Kernel> {
        if !self.kernels.contains_key(&(op, variant)) {
            let k = self.build_kernel(op, variant)?;
            self.kernels.insert((op, variant), k);
        }
        Ok(&self.kernels[&(op, variant)])
    }

    fn build_kernel(&self, op: Op, variant: Variant) -> Result<Kernel> {
        let src = source(op, variant)?;
        let what = format!("building {} [{}]", op.file(), variant.label());
        self.scoped(&what, || {
            let desc = wgpu::ShaderModuleDescriptor {
                label: Some(op.file()),
                source: wgpu::ShaderSource::Wgsl(src.into()),
            };
            let module = if op.bounds_by_construction() {
                // SAFETY: wgpu's requirements for dropping these checks are that the shader
                // never indexes a binding out of bounds and has no infinite loop. The product
                // kernels (`Op::bounds_by_construction`) keep every index in bounds by
                // construction (clamped rows, tokens and columns, chunk counts derived from
                // the buffers' own sizes, host-side checks of the norm weight, bias and
                // output sizes; see the header comments of matvec_common.wgsl and
                // expert_common.wgsl, and tests/gpu_kernels.rs for sizes that are not
                // multiples of anything), and every loop is a counted loop with a uniform
                // bound. Integer division checks stay on.
                let mut checks = wgpu::ShaderRuntimeChecks::checked();
                checks.bounds_checks = false;
                checks.force_loop_bounding = false;
                unsafe { self.device.create_shader_module_trusted(desc, checks) }
            } else {
                self.device.create_shader_module(desc)
            };
            let mut entries = vec![wgpu::BindGroupLayoutEntry {
                binding: 0,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: true,
                    min_binding_size: None,
                },
                count: None,
            }];
            for (i, access) in op.bindings(variant).into_iter().enumerate() {
                entries.push(wgpu::BindGroupLayoutEntry {
                    binding: 1 + i as u32,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Storage { read_only: access == Access::Read },
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    count: None,
                });
            }
            let layout = self.device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(op.file()),
                entries: &entries,
            });
            let pipeline_layout = self.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(op.file()),
                bind_group_layouts: &[Some(&layout)],
                immediate_size: 0,
            });
            let pipeline = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(op.file()),
                layout: Some(&pipeline_layout),
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            });
            Kernel { pipeline, layout }
        })
    }

    /// Builds the kernel now (so that a broken shader fails at load, not mid-token).
    pub fn prepare(&mut self, op: Op, variant: Variant) -> Result<()> {
        self.kernel(op, variant).map(|_| ())
    }

    /// A 2-D grid of at least `n` workgroups: `(nx, ny)` with `nx * ny >= n`.
    pub fn grid(&self, n: u64) -> Result<(u32, u32)> {
        let max = self.max_groups.max(1) as u64;
        let n = n.max(1);
        if n <= max {
            return Ok((n as u32, 1));
        }
        let ny = n.div_ceil(max);
        if ny > max {
            return Err(Error::Backend(format!("{n} workgroups exceed the device's grid")));
        }
        Ok((max as u32, ny as u32))
    }

    fn encoder(&mut self) -> &mut wgpu::CommandEncoder {
        self.encoder.get_or_insert_with(|| {
            self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("picchio") })
        })
    }

    /// Records one dispatch of `op` with `params` (its uniform `p`) and `binds` (bindings
    /// 1..), over `groups` workgroups. An error, recording nothing, when `params` is not the
    /// struct of `op` ([`Op::params`]).
    pub fn dispatch<P: KernelParams>(
        &mut self,
        op: Op,
        variant: Variant,
        params: &P,
        binds: &[Bind<'_>],
        groups: (u32, u32, u32),
    ) -> Result<()> {
        const { assert!(size_of::<P>() <= PARAM_SLOT as usize) };
        let layout = op.params();
        if !layout.is::<P>() {
            return Err(Error::Backend(format!(
                "{}: dispatched with {} parameters; the kernel reads {}",
                op.file(),
                std::any::type_name::<P>(),
                layout.name
            )));
        }
        if groups.0 == 0 || groups.1 == 0 || groups.2 == 0 {
            return Ok(());
        }
        for b in binds {
            if b.size > self.max_binding {
                return Err(Error::Backend(format!(
                    "{}: a binding of {} bytes exceeds max_storage_buffer_binding_size {}",
                    op.file(),
                    b.size,
                    self.max_binding
                )));
            }
        }
        if self.params.len() as u64 + PARAM_SLOT > self.params_buf.size {
            self.flush()?;
        }
        let offset = self.params.len() as u32;
        self.params.extend_from_slice(bytemuck::bytes_of(params));
        self.params.resize(offset as usize + PARAM_SLOT as usize, 0);

        let key =
            BindKey { op, variant, buffers: binds.iter().map(|b| (b.buf.id, b.offset, b.size)).collect() };
        if !self.binds.contains_key(&key) {
            if self.binds.len() > 4096 {
                self.binds.clear();
            }
            let params_buf = self.params_buf.buf.clone();
            let layout = self.kernel(op, variant)?.layout.clone();
            let mut entries = vec![wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &params_buf,
                    offset: 0,
                    size: wgpu::BufferSize::new(PARAM_SLOT),
                }),
            }];
            for (i, b) in binds.iter().enumerate() {
                entries.push(wgpu::BindGroupEntry {
                    binding: 1 + i as u32,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &b.buf.buf,
                        offset: b.offset,
                        size: wgpu::BufferSize::new(b.size),
                    }),
                });
            }
            let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(op.file()),
                layout: &layout,
                entries: &entries,
            });
            self.binds.insert(key.clone(), group);
        }
        let pipeline = self.kernel(op, variant)?.pipeline.clone();
        let group = self.binds[&key].clone();
        if self.pass.is_none() {
            let pass = self
                .encoder()
                .begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("picchio"),
                    timestamp_writes: None,
                })
                .forget_lifetime();
            self.pass = Some(pass);
        }
        if let Some(pass) = self.pass.as_mut() {
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &group, &[offset]);
            pass.dispatch_workgroups(groups.0, groups.1, groups.2);
        }
        self.counters.dispatches += 1;
        self.since_submit += 1;
        if self.since_submit >= SUBMIT_EVERY {
            // Let the device start on what is recorded while the host records the rest.
            self.flush()?;
        }
        Ok(())
    }

    /// Records a buffer-to-buffer copy (sizes and offsets in whole words).
    pub fn copy(&mut self, src: &GBuf, src_offset: u64, dst: &GBuf, dst_offset: u64, size: u64) {
        if size == 0 {
            return;
        }
        self.pass = None;
        self.encoder().copy_buffer_to_buffer(&src.buf, src_offset, &dst.buf, dst_offset, size);
    }

    /// Records a timestamp at `index` of `set`, in order with the recorded work: an empty
    /// compute pass that writes only its beginning timestamp (TIMESTAMP_QUERY, no
    /// timestamps inside passes or encoders needed). On Vulkan it is written once all
    /// earlier commands have completed.
    pub fn write_marker(&mut self, set: &wgpu::QuerySet, index: u32) {
        self.pass = None;
        let pass = self.encoder().begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("picchio timestamp"),
            timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                query_set: set,
                beginning_of_pass_write_index: Some(index),
                end_of_pass_write_index: None,
            }),
        });
        drop(pass);
    }

    /// Records resolving timestamps `0..count` of `set` into `dst` (QUERY_RESOLVE usage).
    pub fn resolve_markers(&mut self, set: &wgpu::QuerySet, count: u32, dst: &GBuf) {
        self.pass = None;
        self.encoder().resolve_query_set(set, 0..count, &dst.buf, 0);
    }

    /// Records a copy of host `bytes` into `dst` at `dst_offset`, ordered with the recorded
    /// work (through the staging arena).
    pub fn stage(&mut self, bytes: &[u8], dst: &GBuf, dst_offset: u64) -> Result<()> {
        let len = (bytes.len() as u64).next_multiple_of(4);
        if self.uploads.len() as u64 + len > self.upload_buf.size {
            self.flush()?;
            if len > self.upload_buf.size {
                let size = len.next_power_of_two();
                self.upload_buf = self.buffer(
                    "uploads",
                    size,
                    wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                )?;
            }
        }
        let at = self.uploads.len() as u64;
        self.uploads.extend_from_slice(bytes);
        self.uploads.resize((at + len) as usize, 0);
        let src = self.upload_buf.clone();
        self.copy(&src, at, dst, dst_offset, bytes.len() as u64);
        self.counters.upload_bytes += len;
        Ok(())
    }

    /// Submits everything recorded so far (no wait).
    pub fn flush(&mut self) -> Result<()> {
        self.pass = None;
        if let Some(encoder) = self.encoder.take() {
            if !self.params.is_empty() {
                self.queue.write_buffer(&self.params_buf.buf, 0, &self.params);
            }
            if !self.uploads.is_empty() {
                self.queue.write_buffer(&self.upload_buf.buf, 0, &self.uploads);
            }
            self.queue.submit([encoder.finish()]);
            self.counters.submissions += 1;
        }
        self.since_submit = 0;
        self.params.clear();
        self.uploads.clear();
        self.check()
    }

    /// Submits and waits for the device to go idle (bounds the staging memory of large
    /// uploads).
    pub fn sync(&mut self) -> Result<()> {
        self.flush()?;
        self.queue.submit([]);
        self.device
            .poll(wgpu::PollType::Wait { submission_index: None, timeout: Some(POLL_TIMEOUT) })
            .map_err(|e| backend_err("waiting for the GPU", e))?;
        self.check()
    }

    /// Submits the recorded work plus copies of `ranges` (buffer, offset, bytes), waits,
    /// and returns the bytes, concatenated. One readback.
    pub fn read_back(&mut self, ranges: &[(&GBuf, u64, u64)]) -> Result<Vec<u8>> {
        let total: u64 = ranges.iter().map(|r| r.2.next_multiple_of(4)).sum();
        let need_new = self.staging.as_ref().is_none_or(|s| s.size < total);
        if need_new {
            let size = total.max(4096).next_power_of_two();
            self.staging = Some(self.buffer(
                "readback",
                size,
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            )?);
        }
        let staging = self.staging.clone().ok_or_else(|| Error::Backend("no staging buffer".into()))?;
        let mut at = 0;
        for &(buf, offset, size) in ranges {
            self.copy(buf, offset, &staging, at, size);
            at += size.next_multiple_of(4);
        }
        self.encoder();
        self.flush()?;
        let slot: Arc<Mutex<Option<std::result::Result<(), wgpu::BufferAsyncError>>>> = Arc::default();
        let s = Arc::clone(&slot);
        let slice = staging.buf.slice(..total.max(4));
        slice.map_async(wgpu::MapMode::Read, move |r| {
            *s.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        });
        self.device
            .poll(wgpu::PollType::Wait { submission_index: None, timeout: Some(POLL_TIMEOUT) })
            .map_err(|e| backend_err("waiting for the GPU", e))?;
        self.check()?;
        let mapped = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        match mapped {
            Some(Ok(())) => {}
            Some(Err(e)) => return Err(backend_err("mapping the readback buffer", e)),
            None => return Err(Error::Backend("the readback did not complete".into())),
        }
        let bytes = {
            let view = slice.get_mapped_range().map_err(|e| backend_err("reading back", e))?;
            view[..total as usize].to_vec()
        };
        staging.buf.unmap();
        self.counters.readbacks += 1;
        self.counters.readback_bytes += total;
        Ok(bytes)
    }
}

/// The most bytes a storage binding of this backend may span, on every API: 2^32 - 4.
///
/// On Metal a binding's size reaches the shader as a u32 (naga's MSL keeps the sizes its
/// bounds checks use in 32-bit fields; wgpu-hal saturates larger sizes at `u32::MAX`), and
/// wgpu does not clamp the bindings it accepts to that. The kernels index their bindings with
/// u32 word indices, which the bounds checks would then clamp to the words below 4 GiB: a
/// larger binding would read wrong data past 4 GiB, silently. So no binding exceeds the
/// largest whole number of words below 4 GiB, on every API, whatever the adapter allows.
pub const MAX_BINDING_BYTES: u64 = (1 << 32) - 4;

/// The largest storage binding the backend uses: the adapter's storage binding and buffer
/// limits, `requested` (tests lower it; never below 4096 bytes), and [`MAX_BINDING_BYTES`],
/// rounded down to whole words.
pub fn binding_limit(max_storage_binding: u64, max_buffer: u64, requested: Option<u64>) -> u64 {
    let mut bytes = max_storage_binding.min(max_buffer).min(MAX_BINDING_BYTES);
    if let Some(m) = requested {
        bytes = bytes.min(m.max(4096));
    }
    // Bindings are sized in whole words.
    bytes & !3
}

fn dummy_buffer(device: &wgpu::Device) -> wgpu::Buffer {
    device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("placeholder"),
        size: 16,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bindings_stay_below_4_gib_in_whole_words() {
        const GIB: u64 = 1 << 30;
        assert_eq!(MAX_BINDING_BYTES, 4 * GIB - 4);
        // An adapter allowing 4 GiB or more (Metal reports its buffer limit, often above 4 GiB).
        assert_eq!(binding_limit(u64::MAX, u64::MAX, None), 4 * GIB - 4);
        assert_eq!(binding_limit(4 * GIB, 16 * GIB, None), 4 * GIB - 4);
        assert_eq!(binding_limit(8 * GIB, 6 * GIB, None), 4 * GIB - 4);
        // Below it, the adapter's limits, the smaller one, in whole words.
        assert_eq!(binding_limit(128 << 20, 256 << 20, None), 128 << 20);
        assert_eq!(binding_limit(2 * GIB + 2, 3 * GIB, None), 2 * GIB);
        assert_eq!(binding_limit(3 * GIB, GIB + 7, None), GIB + 4);
        // A requested limit lowers it, never below 4096 bytes, never above the clamp.
        assert_eq!(binding_limit(u64::MAX, u64::MAX, Some(1 << 20)), 1 << 20);
        assert_eq!(binding_limit(u64::MAX, u64::MAX, Some(10)), 4096);
        assert_eq!(binding_limit(u64::MAX, u64::MAX, Some(5 * GIB)), 4 * GIB - 4);
        assert_eq!(binding_limit(128 << 20, u64::MAX, Some(GIB)), 128 << 20);
    }
}
