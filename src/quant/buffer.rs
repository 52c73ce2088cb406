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

    /// Whether the bytes lie in a file mapping (page-cache pages of 4 KiB), which
    /// [`WeightBuf::in_huge_pages`] moves to process memory.
    fn is_file_mapping(&self) -> bool {
        false
    }

    /// A hint that `len` bytes at `offset` will not be read through this region again: a
    /// file mapping drops their page-table entries, so the process no longer holds the pages
    /// and the page cache reclaims them first when memory is short. Reading them again still
    /// works (from the page cache or the file). Other regions ignore it.
    fn release_hint(&self, _offset: usize, _len: usize) {}
}

impl ByteRegion for Mmap {
    fn bytes(&self) -> &[u8] {
        self
    }

    fn is_file_mapping(&self) -> bool {
        true
    }

    fn release_hint(&self, offset: usize, len: usize) {
        #[cfg(unix)]
        if offset.checked_add(len).is_some_and(|end| end <= self.len()) {
            // SAFETY: `Mmap` is a read-only mapping of a file nobody modifies while it is
            // open, so it holds no private pages: MADV_DONTNEED only drops page-table
            // entries, and a later read faults the same bytes in again. An error (nothing
            // dropped) changes nothing.
            let _ = unsafe { self.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) };
        }
        // Elsewhere there is no such advice: the hint is ignored.
        #[cfg(not(unix))]
        let _ = (offset, len);
    }
}

/// Heap bytes aligned to 4 KiB: the unit of direct I/O, and enough for any SIMD load.
///
/// Buffers of at least [`HUGE_PAGE`] (an expert record is about 12 MiB) are mapped straight
/// from the kernel on Unix instead: their pages are zero until first written and, on Linux,
/// backed by transparent huge pages. The allocator's zeroed allocation at this alignment
/// writes every byte itself, faulting the buffer in 4 KiB at a time (about 3,000 faults a
/// record, each zeroing and charging one page) before the read that fills it; measured on the
/// regime benchmark's 64 GB machine, those faults cost a cold prefill more than its reads.
pub struct AlignedBytes {
    ptr: NonNull<u8>,
    len: usize,
    /// The kernel mapping holding the bytes (start, length), when not from the allocator.
    /// Always `None` off Unix, where buffers come from the allocator only.
    #[cfg_attr(not(unix), allow(dead_code))]
    mapping: Option<(NonNull<u8>, usize)>,
}

// SAFETY: AlignedBytes owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBytes {}
// SAFETY: shared access is read-only.
unsafe impl Sync for AlignedBytes {}

/// Alignment of [`AlignedBytes`] (at least).
pub const BYTE_ALIGN: usize = 4096;

/// Size of a transparent huge page on x86-64 and most ARM64 kernels: [`AlignedBytes`] of
/// this size or more come from a kernel mapping aligned to it.
pub const HUGE_PAGE: usize = 2 << 20;

impl AlignedBytes {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        #[cfg(unix)]
        if len >= HUGE_PAGE
            && let Some(mapped) = Self::mapped(len)
        {
            return mapped;
        }
        let layout = Layout::from_size_align(len.max(1), BYTE_ALIGN).expect("buffer size overflows");
        // SAFETY: the layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBytes { ptr, len, mapping: None }
    }

    /// `len` zero bytes in an anonymous mapping whose start is aligned to [`HUGE_PAGE`]
    /// (`None` if the kernel refuses; the allocator is used instead).
    #[cfg(unix)]
    fn mapped(len: usize) -> Option<Self> {
        let map_len = len.checked_add(HUGE_PAGE)?;
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let base = NonNull::new(base.cast::<u8>())?;
        let skip = base.as_ptr().align_offset(HUGE_PAGE);
        // SAFETY: `skip < HUGE_PAGE`, so `skip + len <= map_len`: the pointer stays inside.
        let ptr = unsafe { NonNull::new_unchecked(base.as_ptr().add(skip)) };
        #[cfg(target_os = "linux")]
        // SAFETY: the range lies in the mapping; the advice only changes how the kernel backs
        // it (if refused, 4 KiB pages: correct, only slower).
        unsafe {
            libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE);
        }
        Some(AlignedBytes { ptr, len, mapping: Some((base, map_len)) })
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
        #[cfg(unix)]
        if let Some((base, map_len)) = self.mapping {
            // SAFETY: the mapping made in `mapped`, unmapped once, here.
            unsafe { libc::munmap(base.as_ptr().cast(), map_len) };
            return;
        }
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

    /// On Linux, the same elements copied out of a file mapping into process memory backed
    /// by transparent huge pages ([`AlignedBytes`]), when they view a file mapping and fill
    /// at least one huge page ([`HUGE_PAGE`]); otherwise (other regions, owned or small
    /// buffers, other systems) this buffer itself.
    ///
    /// A file mapping is backed by 4 KiB page-cache pages: a kernel streaming a large matrix
    /// from it pays a TLB miss every 4 KiB, and the hardware prefetcher stops at every page
    /// boundary, and with a working set of gigabytes the page walks miss the caches. On the
    /// 2-core Zen 5 VM, decode's attention products (BF16) took 5-35% less time from huge
    /// pages at 2 threads (docs/perf.md). The mapped range is then released
    /// ([`ByteRegion::release_hint`]): its pages stay in the page cache, which reclaims them
    /// when memory is short.
    pub fn in_huge_pages(&self) -> WeightBuf<T> {
        match self {
            WeightBuf::Shared { region, offset, .. }
                if cfg!(target_os = "linux") && region.is_file_mapping() && self.byte_len() >= HUGE_PAGE =>
            {
                let mut bytes = AlignedBytes::zeroed(self.byte_len());
                bytes.as_mut_slice().copy_from_slice(bytemuck::cast_slice(self.as_slice()));
                region.release_hint(*offset, self.byte_len());
                let copy: Arc<dyn ByteRegion> = Arc::new(bytes);
                WeightBuf::shared(&copy, 0, self.byte_len())
            }
            _ => self.clone(),
        }
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

/// One cache line of f32s: the unit of [`AlignedRows`].
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

// SAFETY: `Line` is `repr(C)`, 16 f32s (64 bytes) with alignment 64: no padding, and every bit
// pattern is valid.
unsafe impl bytemuck::Zeroable for Line {}
// SAFETY: as above; it is `Copy` and `'static`.
unsafe impl bytemuck::Pod for Line {}

/// Rows of f32s copied into a buffer where each row starts on a 64-byte cache line, zero-padded
/// to `len` elements: kernel inputs whose vector loads then never straddle two cache lines (a
/// 32-byte load at 16 bytes past a line does, and costs about twice as much). The distance
/// between rows is kept off multiples of 4 KiB so that rows read together do not compete for
/// the same L1 sets.
pub struct AlignedRows {
    buf: Vec<Line>,
    /// f32s from one row's start to the next's.
    stride: usize,
    /// f32s in each row.
    len: usize,
    /// Number of rows.
    rows: usize,
}

impl AlignedRows {
    /// The rows of `x` (`rows` rows of `cols` each, `cols <= len`), each padded with zeros to
    /// `len` elements.
    pub fn new(x: &[f32], rows: usize, cols: usize, len: usize) -> Self {
        assert!(cols <= len && x.len() == rows * cols, "AlignedRows: {} values for {rows} x {cols}", x.len());
        let mut stride = len.div_ceil(16) * 16;
        if stride.is_multiple_of(1024) {
            stride += 16;
        }
        let mut buf = vec![Line([0.0; 16]); (rows * stride).div_ceil(16)];
        let flat: &mut [f32] = bytemuck::cast_slice_mut(&mut buf);
        for (dst, src) in flat.chunks_mut(stride).zip(x.chunks(cols.max(1))) {
            dst[..cols].copy_from_slice(src);
        }
        AlignedRows { buf, stride, len, rows }
    }

    /// Row `i` (`len` elements).
    pub fn row(&self, i: usize) -> &[f32] {
        let flat: &[f32] = bytemuck::cast_slice(&self.buf);
        &flat[i * self.stride..][..self.len]
    }

    /// Every row, in order.
    pub fn rows(&self) -> impl Iterator<Item = &[f32]> {
        (0..self.rows).map(|i| self.row(i))
    }

    /// Row `i` (`len` elements), to rearrange in place.
    pub fn row_mut(&mut self, i: usize) -> &mut [f32] {
        let flat: &mut [f32] = bytemuck::cast_slice_mut(&mut self.buf);
        &mut flat[i * self.stride..][..self.len]
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn large_buffers_are_zeroed_aligned_and_writable_end_to_end() {
        for len in [HUGE_PAGE, 12 * (1 << 20) + 4096, 4096, 100] {
            let mut b = AlignedBytes::zeroed(len);
            assert_eq!(b.len(), len);
            let align = if len >= HUGE_PAGE && cfg!(unix) { HUGE_PAGE } else { BYTE_ALIGN };
            assert_eq!(b.bytes().as_ptr() as usize % align, 0, "{len}");
            assert!(b.bytes().iter().all(|&x| x == 0), "{len}: not zeroed");
            let s = b.as_mut_slice();
            s[0] = 1;
            s[len - 1] = 2;
            assert_eq!((b.bytes()[0], b.bytes()[len - 1]), (1, 2));
        }
    }

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

    #[test]
    fn aligned_rows_start_on_cache_lines_and_are_zero_padded() {
        let x: Vec<f32> = (0..3 * 1024).map(|i| i as f32).collect();
        for (cols, len) in [(1024, 1024), (1000, 1024), (7, 7), (1024, 1088)] {
            let a = AlignedRows::new(&x[..3 * cols], 3, cols, len);
            let rows: Vec<&[f32]> = a.rows().collect();
            assert_eq!(rows.len(), 3);
            for (r, row) in rows.iter().enumerate() {
                assert_eq!(row.as_ptr() as usize % 64, 0);
                assert_eq!(row.len(), len);
                assert_eq!(&row[..cols], &x[r * cols..(r + 1) * cols]);
                assert!(row[cols..].iter().all(|&v| v == 0.0));
            }
            let stride = rows[1].as_ptr() as usize - rows[0].as_ptr() as usize;
            assert_ne!(stride % 4096, 0, "rows {cols}/{len} are a multiple of 4 KiB apart");
        }
        assert_eq!(AlignedRows::new(&[], 0, 5, 8).rows().count(), 0);
    }

    /// `bytes` written to a temporary file and memory-mapped, as a container's dense.bin is.
    fn mapped(bytes: &[u8]) -> Arc<dyn ByteRegion> {
        let mut file = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut file, bytes).unwrap();
        // SAFETY: a private temporary file nobody else modifies.
        Arc::new(unsafe { Mmap::map(&file) }.unwrap())
    }

    #[test]
    fn large_views_of_a_file_mapping_move_to_process_memory_with_the_same_bytes() {
        let bytes: Vec<u8> = (0..HUGE_PAGE + 3 * 4096).map(|i| (i * 7 % 251) as u8).collect();
        let map = mapped(&bytes);
        let region_of = |b: &WeightBuf<u16>| match b {
            WeightBuf::Shared { region, offset, .. } => Some((region.is_file_mapping(), *offset)),
            WeightBuf::Owned(_) => None,
        };
        // A view of one huge page or more, at an offset inside the file.
        let large = WeightBuf::<u16>::shared(&map, 4096, HUGE_PAGE);
        let moved = large.in_huge_pages();
        assert_eq!(moved.as_slice(), large.as_slice());
        assert_eq!(moved.as_slice(), bytemuck::cast_slice::<u8, u16>(&bytes[4096..4096 + HUGE_PAGE]));
        let expected = if cfg!(target_os = "linux") { Some((false, 0)) } else { Some((true, 4096)) };
        assert_eq!(region_of(&moved), expected);
        // The source stays readable after its range was released.
        assert_eq!(large.as_slice(), bytemuck::cast_slice::<u8, u16>(&bytes[4096..4096 + HUGE_PAGE]));
        // Smaller views stay where they are, as do owned buffers.
        let small = WeightBuf::<u16>::shared(&map, 0, HUGE_PAGE - 4096);
        assert_eq!(region_of(&small.in_huge_pages()), Some((true, 0)));
        let owned = WeightBuf::owned(vec![1u16; HUGE_PAGE]);
        assert_eq!(region_of(&owned.in_huge_pages()), None);
        // A view of a region already in process memory is not copied again.
        let again = moved.in_huge_pages();
        assert_eq!(again.as_slice().as_ptr(), moved.as_slice().as_ptr());
    }
}
