//! Positioned reads and writes that work the same on every platform, so several threads
//! can share one file handle without a shared cursor.

use std::fs::File;
use std::io;

/// Reads exactly `buf.len()` bytes at `offset`; a short file is an `UnexpectedEof` error.
pub fn read_exact_at(file: &File, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        match read_at(file, buf, offset) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("short read: {} bytes missing at offset {offset}", buf.len()),
                ));
            }
            Ok(n) => {
                buf = &mut buf[n..];
                offset = advance(offset, n)?;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf` at `offset`.
pub fn write_all_at(file: &File, mut buf: &[u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        match write_at(file, buf, offset) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "write returned zero bytes")),
            Ok(n) => {
                buf = &buf[n..];
                offset = advance(offset, n)?;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `offset + n`, or an error where that passes the largest file offset.
fn advance(offset: u64, n: usize) -> io::Result<u64> {
    offset
        .checked_add(n as u64)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "file offset overflows"))
}

#[cfg(unix)]
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    std::os::unix::fs::FileExt::read_at(file, buf, offset)
}

#[cfg(unix)]
fn write_at(file: &File, buf: &[u8], offset: u64) -> io::Result<usize> {
    std::os::unix::fs::FileExt::write_at(file, buf, offset)
}

#[cfg(windows)]
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    std::os::windows::fs::FileExt::seek_read(file, buf, offset)
}

#[cfg(windows)]
fn write_at(file: &File, buf: &[u8], offset: u64) -> io::Result<usize> {
    std::os::windows::fs::FileExt::seek_write(file, buf, offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positioned_round_trip_and_short_read() {
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("x"))
            .unwrap();
        write_all_at(&f, b"hello", 10).unwrap();
        let mut buf = [0u8; 5];
        read_exact_at(&f, &mut buf, 10).unwrap();
        assert_eq!(&buf, b"hello");
        let err = read_exact_at(&f, &mut [0u8; 8], 12).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
