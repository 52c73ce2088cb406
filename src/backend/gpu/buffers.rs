//! Activations and routing decisions on the device, in a pool of reusable buffers: a
//! buffer goes back to the pool when its activation is dropped, so steady-state decoding
//! allocates nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::Result;

use super::context::{Bind, GBuf, Gpu};

type Free = Arc<Mutex<HashMap<u64, Vec<GBuf>>>>;

/// Reusable storage buffers by size class (powers of two).
#[derive(Clone, Default)]
pub struct BufferPool {
    free: Free,
}

/// A pooled buffer; returns to its pool when dropped.
pub struct Pooled {
    buf: Option<GBuf>,
    free: Free,
}

impl Pooled {
    /// The buffer.
    pub fn buf(&self) -> &GBuf {
        // Only `drop` takes the buffer out.
        self.buf.as_ref().expect("pooled buffer present until drop")
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.free.lock().unwrap_or_else(|p| p.into_inner()).entry(b.size).or_default().push(b);
        }
    }
}

impl BufferPool {
    /// A buffer of at least `bytes` bytes (contents unspecified).
    pub fn take(&self, gpu: &mut Gpu, bytes: u64) -> Result<Pooled> {
        let class = bytes.max(256).next_power_of_two();
        let reused = self.free.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&class).and_then(Vec::pop);
        let buf = match reused {
            Some(b) => b,
            None => gpu.buffer(
                "activation",
                class,
                wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            )?,
        };
        Ok(Pooled { buf: Some(buf), free: Arc::clone(&self.free) })
    }
}

/// `[rows, width]` f32 activations on the device.
pub struct GpuAct {
    rows: usize,
    width: usize,
    mem: Pooled,
}

impl GpuAct {
    pub(super) fn new(rows: usize, width: usize, mem: Pooled) -> Self {
        GpuAct { rows, width, mem }
    }

    /// Rows (positions).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Width of a row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Bytes of the valid contents.
    pub fn bytes(&self) -> u64 {
        (self.rows * self.width * 4) as u64
    }

    pub(super) fn buf(&self) -> &GBuf {
        self.mem.buf()
    }

    pub(super) fn bind(&self) -> Bind<'_> {
        Bind::first(self.mem.buf(), self.bytes())
    }
}

/// A routing decision on the device: per row, `k` expert indices then `k` weights (f32
/// bits), as `router_topk.wgsl` writes it.
pub struct GpuRoutes {
    rows: usize,
    k: usize,
    mem: Pooled,
}

impl GpuRoutes {
    pub(super) fn new(rows: usize, k: usize, mem: Pooled) -> Self {
        GpuRoutes { rows, k, mem }
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Experts per row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes of the valid contents.
    pub fn bytes(&self) -> u64 {
        (self.rows * 2 * self.k * 4) as u64
    }

    pub(super) fn buf(&self) -> &GBuf {
        self.mem.buf()
    }

    pub(super) fn bind(&self) -> Bind<'_> {
        Bind::first(self.mem.buf(), self.bytes())
    }
}

/// Decodes routes read back from the device.
pub fn decode_routes(bytes: &[u8], rows: usize, k: usize) -> crate::backend::RouteTable {
    let words = words(&bytes[..rows * 2 * k * 4]);
    let mut t = crate::backend::RouteTable {
        k,
        experts: Vec::with_capacity(rows * k),
        weights: Vec::with_capacity(rows * k),
    };
    for row in words.chunks(2 * k) {
        t.experts.extend_from_slice(&row[..k]);
        t.weights.extend(row[k..].iter().map(|&w| f32::from_bits(w)));
    }
    t
}

/// Little-endian u32 words of `bytes` (any alignment).
pub fn words(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Little-endian f32 values of `bytes` (any alignment).
pub fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
