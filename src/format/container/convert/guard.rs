//! Guards a conversion takes before writing anything: the output must not be, contain or
//! alias the source, and only one conversion may write an output directory at a time.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// File in the output directory that a running conversion holds locked.
pub const LOCK_FILE: &str = "convert.lock";

/// Refuses an output directory that is the source, lies inside it, or contains it, by
/// canonical path (so symlinks and `..` are seen through) and by device and inode of every
/// ancestor (so bind mounts and hard-linked directories are too). An output that does not
/// exist yet is judged by its nearest existing ancestor. Nothing is written.
///
/// Returns the resolved output path (canonical existing ancestor plus the missing names,
/// `..` applied), which the conversion then writes to, so that creating it cannot make
/// directories anywhere a `..` in the missing part passes through.
pub fn check_not_aliased(src: &Path, out: &Path) -> Result<PathBuf> {
    let src_c = src.canonicalize().map_err(|e| Error::io(src, e))?;
    let (existing, rest) = nearest_existing(out)?;
    let out_c = apply_lexically(&existing, &rest);
    let refuse = |why: &str| Err(Error::invalid(aliasing_message(src, out, why)));
    if out_c == src_c {
        return refuse("is the source directory");
    }
    if out_c.starts_with(&src_c) {
        return refuse("is inside the source directory");
    }
    if src_c.starts_with(&out_c) {
        return refuse("contains the source directory");
    }
    let src_id = file_id(&src_c)?;
    for (n, ancestor) in out_c.ancestors().enumerate() {
        // The missing tail has no identity yet; everything above it does.
        if ancestor.exists() && file_id(ancestor)? == src_id {
            return refuse(if n == 0 { "is the source directory" } else { "is inside the source directory" });
        }
    }
    if out_c.exists() {
        let out_id = file_id(&out_c)?;
        for ancestor in src_c.ancestors() {
            if file_id(ancestor)? == out_id {
                return refuse("contains the source directory");
            }
        }
    }
    Ok(out_c)
}

/// The message for an output that aliases the source.
fn aliasing_message(src: &Path, out: &Path, why: &str) -> String {
    let hint = match why {
        "contains the source directory" => "the source is inside the output",
        "is inside the source directory" => "the output is inside the source",
        _ => "converting in place would overwrite the checkpoint",
    };
    format!(
        "output {} {why} {} ({hint}); nothing was written, choose an output directory apart from the source",
        out.display(),
        src.display()
    )
}

/// The canonical form of the nearest existing ancestor of `path` (itself if it exists) and
/// the components below it that do not exist yet.
fn nearest_existing(path: &Path) -> Result<(PathBuf, Vec<Component<'_>>)> {
    let mut existing = path;
    let mut rest = Vec::new();
    loop {
        if existing.as_os_str().is_empty() {
            let cwd = std::env::current_dir().map_err(|e| Error::io(".", e))?;
            return Ok((cwd.canonicalize().map_err(|e| Error::io(&cwd, e))?, rest));
        }
        if existing.exists() {
            let c = existing.canonicalize().map_err(|e| Error::io(existing, e))?;
            rest.reverse();
            return Ok((c, rest));
        }
        let Some(name) = existing.components().next_back() else {
            return Err(Error::format(path, "output path has no existing ancestor"));
        };
        rest.push(name);
        existing = existing.parent().unwrap_or(Path::new(""));
    }
}

/// `base` (canonical) with `rest` applied as plain names: `.` skipped, `..` going up.
/// Exact, because nothing below `base` exists yet, so none of it is a symlink.
fn apply_lexically(base: &Path, rest: &[Component<'_>]) -> PathBuf {
    let mut p = base.to_path_buf();
    for c in rest {
        match c {
            Component::ParentDir => {
                p.pop();
            }
            Component::Normal(n) => p.push(n),
            _ => {}
        }
    }
    p
}

/// Device and inode of `path` (following symlinks).
#[cfg(unix)]
fn file_id(path: &Path) -> Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    Ok((m.dev(), m.ino()))
}

/// Without inodes, canonical paths are the only identity.
#[cfg(not(unix))]
fn file_id(path: &Path) -> Result<PathBuf> {
    path.canonicalize().map_err(|e| Error::io(path, e))
}

/// An exclusive advisory lock on [`LOCK_FILE`] in an output directory, held while the
/// conversion writes it. The operating system releases it when the holder exits or dies,
/// so a killed conversion never leaves a stale lock. The file (holding the holder's pid)
/// is left in place: removing it could let two processes lock two different files.
#[derive(Debug)]
pub struct OutputLock {
    _file: File,
}

impl OutputLock {
    /// Takes the lock without waiting; fails naming the directory and the holder's pid
    /// when another conversion holds it.
    pub fn acquire(out: &Path) -> Result<Self> {
        let path = out.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut pid = String::new();
                let _ = file.read_to_string(&mut pid);
                let pid = pid.trim();
                let pid = if pid.is_empty() { "unknown" } else { pid };
                return Err(Error::invalid(format!(
                    "another conversion is writing {} (pid {pid}); wait for it to finish or stop it",
                    out.display()
                )));
            }
            Err(TryLockError::Error(e)) => return Err(Error::io(&path, e)),
        }
        file.set_len(0).map_err(|e| Error::io(&path, e))?;
        file.seek(SeekFrom::Start(0)).map_err(|e| Error::io(&path, e))?;
        write!(file, "{}", std::process::id()).map_err(|e| Error::io(&path, e))?;
        Ok(OutputLock { _file: file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_outputs_are_judged_by_their_nearest_existing_ancestor() {
        let src = tempfile::tempdir().unwrap();
        let e = check_not_aliased(src.path(), &src.path().join("x/../y/./z")).unwrap_err();
        assert!(e.to_string().contains("inside the source"), "{e}");
        // Going up out of the source through `..` in the missing part is allowed.
        let resolved =
            check_not_aliased(&src.path().join("."), &src.path().join("x/../../elsewhere")).unwrap();
        let parent = src.path().canonicalize().unwrap().parent().unwrap().to_path_buf();
        assert_eq!(resolved, parent.join("elsewhere"));
        let e = check_not_aliased(src.path(), &src.path().join("x/..")).unwrap_err();
        assert!(e.to_string().contains("is the source"), "{e}");
    }

    #[test]
    fn the_lock_is_exclusive_and_released_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let held = OutputLock::acquire(dir.path()).unwrap();
        let e = OutputLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(held);
        OutputLock::acquire(dir.path()).unwrap();
    }
}
