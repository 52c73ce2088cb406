//! `WeightBuf`: a typed, read-only slice of weights that either owns its memory or borrows
//! a region of a memory-mapped file, so dense weights can stay in the page cache (mmap)
//! while decoded or converted tensors live on the heap, behind one type.

use std::sync::Arc;

use bytemuck::Pod;
use memmap2::Mmap;

/// A read-only array of `T`, owned or mapped from a file.
#[derive(Clone)]
pub enum WeightBuf<T: Pod> {
    /// Heap memory.
    Owned(Arc<[T]>),
    /// `len` elements starting `offset` bytes into a shared file mapping.
    Mapped {
        /// The mapping (kept alive by every buffer that points into it).
        map: Arc<Mmap>,
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

    /// Borrows `bytes` bytes at `offset` of `map` as `T`s. Falls back to a copy when the
    /// region is not aligned for `T` (safetensors does not promise alignment).
    ///
    /// Panics if the region lies outside the mapping or is not a whole number of `T`s;
    /// callers validate file layouts before building buffers.
    pub fn mapped(map: &Arc<Mmap>, offset: usize, bytes: usize) -> Self {
        let size = std::mem::size_of::<T>();
        assert!(bytes.is_multiple_of(size), "region of {bytes} bytes is not a whole number of elements");
        let region = &map[offset..offset + bytes];
        if (region.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
            WeightBuf::Mapped { map: Arc::clone(map), offset, len: bytes / size }
        } else {
            let mut v = vec![T::zeroed(); bytes / size];
            bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(region);
            WeightBuf::owned(v)
        }
    }

    /// The elements.
    pub fn as_slice(&self) -> &[T] {
        match self {
            WeightBuf::Owned(v) => v,
            WeightBuf::Mapped { map, offset, len } => {
                bytemuck::cast_slice(&map[*offset..*offset + len * std::mem::size_of::<T>()])
            }
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            WeightBuf::Owned(v) => v.len(),
            WeightBuf::Mapped { len, .. } => *len,
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
            WeightBuf::Mapped { .. } => "mapped",
        };
        write!(f, "WeightBuf<{}>({kind}, {} elements)", std::any::type_name::<T>(), self.len())
    }
}
