//! `WeightBuf`: a typed, read-only slice of weights that either owns its memory or views a
//! region of shared bytes (a memory-mapped file, or an aligned buffer an expert was read
//! into), so every weight format has one storage type whatever the weights came from.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::sync::Arc;

use bytemuck::Pod;
use memmap2::Mmap;

/// Read-only bytes that weight buffers can point into.
pub trait ByteRegion: Send + Sync {
    /// The bytes.
    fn bytes(&self) -> &[u8];
}

impl ByteRegion for Mmap {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// Heap bytes aligned to 4 KiB: the unit of direct I/O, and enough for any SIMD load.
pub struct AlignedBytes {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBytes owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBytes {}
// SAFETY: shared access is read-only.
unsafe impl Sync for AlignedBytes {}

/// Alignment of [`AlignedBytes`].
pub const BYTE_ALIGN: usize = 4096;

impl AlignedBytes {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        let layout = Layout::from_size_align(len.max(1), BYTE_ALIGN).expect("buffer size overflows");
        // SAFETY: the layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBytes { ptr, len }
    }

    /// The bytes, writable (before the buffer is shared).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len bytes and uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl ByteRegion for AlignedBytes {
    fn bytes(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes for the buffer's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len.max(1), BYTE_ALIGN).expect("layout was valid");
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// A read-only array of `T`, owned or viewing shared bytes.
#[derive(Clone)]
pub enum WeightBuf<T: Pod> {
    /// Heap memory.
    Owned(Arc<[T]>),
    /// `len` elements starting `offset` bytes into a shared region.
    Shared {
        /// The region (kept alive by every buffer that points into it).
        region: Arc<dyn ByteRegion>,
        /// Byte offset of the first element; a multiple of `align_of::<T>()`.
        offset: usize,
        /// Number of elements.
        len: usize,
    },
}

impl<T: Pod> WeightBuf<T> {
    /// Wraps heap data.
    pub fn owned(data: Vec<T>) -> Self {
        WeightBuf::Owned(data.into())
    }

    /// Views `bytes` bytes at `offset` of `region` as `T`s. Falls back to a copy when the
    /// region is not aligned for `T` (safetensors does not promise alignment).
    ///
    /// Panics if the range lies outside the region or is not a whole number of `T`s;
    /// callers validate file layouts before building buffers.
    pub fn shared(region: &Arc<dyn ByteRegion>, offset: usize, bytes: usize) -> Self {
        let size = std::mem::size_of::<T>();
        assert!(bytes.is_multiple_of(size), "region of {bytes} bytes is not a whole number of elements");
        let slice = &region.bytes()[offset..offset + bytes];
        if (slice.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
            WeightBuf::Shared { region: Arc::clone(region), offset, len: bytes / size }
        } else {
            let mut v = vec![T::zeroed(); bytes / size];
            bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(slice);
            WeightBuf::owned(v)
        }
    }

    /// The elements.
    pub fn as_slice(&self) -> &[T] {
        match self {
            WeightBuf::Owned(v) => v,
            WeightBuf::Shared { region, offset, len } => {
                bytemuck::cast_slice(&region.bytes()[*offset..*offset + len * std::mem::size_of::<T>()])
            }
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            WeightBuf::Owned(v) => v.len(),
            WeightBuf::Shared { len, .. } => *len,
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }
}

impl<T: Pod + std::fmt::Debug> std::fmt::Debug for WeightBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            WeightBuf::Owned(_) => "owned",
            WeightBuf::Shared { .. } => "shared",
        };
        write!(f, "WeightBuf<{}>({kind}, {} elements)", std::any::type_name::<T>(), self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_bytes_are_aligned_and_zeroed() {
        let mut b = AlignedBytes::zeroed(10_000);
        assert_eq!(b.as_mut_slice().as_ptr() as usize % BYTE_ALIGN, 0);
        assert!(b.bytes().iter().all(|&x| x == 0));
        b.as_mut_slice()[9_999] = 7;
        let region: Arc<dyn ByteRegion> = Arc::new(b);
        let view = WeightBuf::<u8>::shared(&region, 9_998, 2);
        assert_eq!(view.as_slice(), &[0, 7]);
        // Misaligned f32 view falls back to a copy with the same values.
        let v = WeightBuf::<f32>::shared(&region, 1, 4);
        assert!(matches!(v, WeightBuf::Owned(_)));
        assert_eq!(v.as_slice(), &[0.0]);
    }
}
