//! A usable `XDG_RUNTIME_DIR` for Mesa, so probing GPU adapters prints nothing.
//!
//! Mesa's Vulkan and GL drivers (lavapipe and llvmpipe included) connect to a display when
//! an instance is created, and print `error: XDG_RUNTIME_DIR is invalid or not set in the
//! environment.` on stderr (twice, past any log filter) when that variable is missing, as
//! on servers, in containers and under `sudo`. Compute needs no display; a private
//! directory in its place silences the message and changes nothing else.

/// Points `XDG_RUNTIME_DIR` at `$TMPDIR/picchio-runtime-UID` (created with mode 0700) when
/// it is unset or not a directory. A directory of that name that another user owns, or
/// that others can enter, is not used (the message then stays). Linux only.
///
/// Call it first thing in `main`, while the process has one thread: changing the
/// environment is only sound then.
pub fn ensure() {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
        use std::path::Path;

        let usable = std::env::var_os("XDG_RUNTIME_DIR")
            .is_some_and(|d| Path::new(&d).is_absolute() && Path::new(&d).is_dir());
        if usable {
            return;
        }
        let Ok(uid) = std::fs::metadata("/proc/self").map(|m| m.uid()) else { return };
        let dir = std::env::temp_dir().join(format!("picchio-runtime-{uid}"));
        let _ = std::fs::DirBuilder::new().mode(0o700).create(&dir);
        let private = std::fs::symlink_metadata(&dir)
            .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.permissions().mode() & 0o077 == 0);
        if private {
            // SAFETY: called at the start of `main`, before any other thread exists, so no
            // one reads the environment concurrently.
            unsafe { std::env::set_var("XDG_RUNTIME_DIR", &dir) };
        }
    }
}
