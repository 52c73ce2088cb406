//! Minimal NumPy `.npy` (version 1.0) writer for f32 arrays, for dumping logits and
//! checkpoints that Python can load with `numpy.load`.

use std::io::Write;
use std::path::Path;

use crate::error::{Error, Result};

/// Writes a little-endian f32 array of `shape` to `path`.
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    let count = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    if count != Some(data.len()) {
        let count = count.map_or("more than usize::MAX".to_string(), |c| c.to_string());
        return Err(Error::invalid(format!("npy: shape {shape:?} holds {count} values, got {}", data.len())));
    }
    let dims = match shape {
        [n] => format!("({n},)"),
        _ => format!("({})", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {dims}, }}");
    // Magic (6) + version (2) + length (2) + header + '\n' must be a multiple of 64.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let header_len = u16::try_from(header.len()).map_err(|_| {
        Error::invalid(format!("npy: shape {shape:?} makes a header longer than 65535 bytes"))
    })?;
    let mut out = Vec::with_capacity(10 + header.len() + data.len() * 4);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&header_len.to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    let mut f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    f.write_all(&out).map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_aligned_and_data_follows() {
        let dir = std::env::temp_dir().join(format!("picchio-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.npy");
        write_f32(&p, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[..6], b"\x93NUMPY");
        let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!((10 + hlen) % 64, 0);
        let header = std::str::from_utf8(&bytes[10..10 + hlen]).unwrap();
        assert!(header.contains("'shape': (2, 3)"), "{header}");
        let data = &bytes[10 + hlen..];
        assert_eq!(data.len(), 24);
        assert_eq!(f32::from_le_bytes(data[20..24].try_into().unwrap()), 6.0);
        assert!(write_f32(&p, &[4], &[1.0]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
