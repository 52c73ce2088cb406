//! Facts about the machine: physical memory, this process's peak resident memory, the CPU.

/// The memory this process may use in bytes: the machine's physical memory, or less where
/// a memory cgroup limits the process (a container started with `docker run --memory`, a
/// systemd slice), so that caches sized from it fit inside the limit instead of being
/// killed by it. `None` if the platform reports neither.
pub fn total_memory() -> Option<u64> {
    let mut sys = sysinfo::System::new().ok()?;
    sys.refresh_memory();
    let physical = sys.total_memory();
    let physical = (physical > 0).then_some(physical);
    match (physical, cgroup_memory_limit()) {
        (Some(p), Some(c)) => Some(p.min(c)),
        (p, c) => p.or(c),
    }
}

/// The tightest memory limit of this process's cgroup and its ancestors (cgroup v2
/// `memory.max`, v1 `memory.limit_in_bytes`), if any is set. Linux only.
pub fn cgroup_memory_limit() -> Option<u64> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_limit_from(&membership, std::path::Path::new("/sys/fs/cgroup"), &|p| {
        std::fs::read_to_string(p).ok()
    })
}

/// [`cgroup_memory_limit`] from the text of `/proc/self/cgroup` (`membership`), the cgroup
/// file systems' mount point (`root`) and a file reader: the smallest limit along the
/// process's cgroup path, from its own cgroup up to the root. "max" and v1's "no limit"
/// (a value near `i64::MAX`) are no limit.
pub fn cgroup_limit_from(
    membership: &str,
    root: &std::path::Path,
    read: &dyn Fn(&std::path::Path) -> Option<String>,
) -> Option<u64> {
    /// v1 reports "no limit" as the largest page-aligned i64; anything above 2^60 is it.
    const NO_LIMIT: u64 = 1 << 60;
    let parse = |text: Option<String>| -> Option<u64> {
        let t = text?;
        let t = t.trim();
        if t == "max" {
            return None;
        }
        t.parse::<u64>().ok().filter(|&v| v > 0 && v < NO_LIMIT)
    };
    // Every directory from the cgroup up to the root of its hierarchy, then the smallest
    // limit among them.
    let walk = |base: std::path::PathBuf, path: &str, file: &str| -> Option<u64> {
        let mut dir = base.join(path.trim_start_matches('/'));
        let mut best: Option<u64> = None;
        loop {
            if let Some(v) = parse(read(&dir.join(file))) {
                best = Some(best.map_or(v, |b| b.min(v)));
            }
            if dir == base || !dir.pop() || !dir.starts_with(&base) {
                break;
            }
        }
        best
    };
    let mut limit: Option<u64> = None;
    for line in membership.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let found = if controllers.is_empty() {
            walk(root.to_path_buf(), path, "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            walk(root.join("memory"), path, "memory.limit_in_bytes")
        } else {
            None
        };
        if let Some(v) = found {
            limit = Some(limit.map_or(v, |l| l.min(v)));
        }
    }
    limit
}

/// Memory left to the OS and everything else when Picchio sizes its caches from a machine
/// of `total` bytes: 4 GiB, or a quarter of it on small machines.
pub fn reserve(total: u64) -> u64 {
    (4u64 << 30).min(total / 4)
}

/// Memory available to new allocations in bytes (free plus reclaimable caches, as the
/// OS counts it), if the platform reports it. Used in messages about allocations that do
/// not fit.
pub fn available_memory() -> Option<u64> {
    let mut sys = sysinfo::System::new().ok()?;
    sys.refresh_memory();
    let available = sys.available_memory();
    (available > 0).then_some(available)
}

/// Peak resident set size of this process so far, in bytes.
pub fn peak_rss() -> Option<u64> {
    #[cfg(unix)]
    {
        // SAFETY: getrusage only writes into the zeroed struct we pass.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: valid pointer to a rusage struct.
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
            return None;
        }
        let max = usage.ru_maxrss as u64;
        // Linux reports KiB, macOS bytes.
        if cfg!(target_os = "macos") { Some(max) } else { Some(max * 1024) }
    }
    #[cfg(not(unix))]
    {
        let pid = sysinfo::get_current_pid().ok()?;
        let mut sys = sysinfo::System::new().ok()?;
        sys.refresh_processes(sysinfo::ProcessesToUpdate::Some(&[pid]), true);
        sys.process(pid).map(|p| p.memory())
    }
}

/// The CPU's brand string and the number of logical cores.
pub fn cpu_description() -> String {
    let brand = sysinfo::System::new()
        .ok()
        .and_then(|mut sys| {
            sys.refresh_cpu_all();
            sys.cpus().first().map(|c| c.brand().trim().to_string())
        })
        .unwrap_or_default();
    let brand = if brand.is_empty() { std::env::consts::ARCH.to_string() } else { brand };
    format!("{brand}, {} logical cores", std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Formats a byte count for people: `512 B`, `3.4 KiB`, `12.0 MiB`, `1.25 GiB`.
pub fn gib(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, size) in UNITS {
        if bytes >= size {
            let v = bytes as f64 / size as f64;
            return if unit == "GiB" { format!("{v:.2} {unit}") } else { format!("{v:.1} {unit}") };
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::{Path, PathBuf};

    fn files(list: &[(&str, &str)]) -> HashMap<PathBuf, String> {
        list.iter().map(|(p, t)| (PathBuf::from(p), t.to_string())).collect()
    }

    fn limit(membership: &str, fs: &HashMap<PathBuf, String>) -> Option<u64> {
        super::cgroup_limit_from(membership, Path::new("/sys/fs/cgroup"), &|p| fs.get(p).cloned())
    }

    #[test]
    fn cgroup_v2_limits_are_the_tightest_along_the_path() {
        let fs = files(&[
            ("/sys/fs/cgroup/memory.max", "max\n"),
            ("/sys/fs/cgroup/user.slice/memory.max", "17179869184\n"),
            ("/sys/fs/cgroup/user.slice/app/memory.max", "max\n"),
        ]);
        assert_eq!(limit("0::/user.slice/app\n", &fs), Some(16 << 30));
        // A container: its own namespace, the limit at the root.
        let docker = files(&[("/sys/fs/cgroup/memory.max", "8589934592")]);
        assert_eq!(limit("0::/\n", &docker), Some(8 << 30));
        // No limit anywhere, or unreadable files: none.
        assert_eq!(limit("0::/user.slice/app\n", &files(&[("/sys/fs/cgroup/memory.max", "max")])), None);
        assert_eq!(limit("0::/x\n", &files(&[])), None);
    }

    #[test]
    fn cgroup_v1_reads_the_memory_hierarchy_and_ignores_its_no_limit_value() {
        let fs = files(&[
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712"),
            ("/sys/fs/cgroup/memory/picchio/memory.limit_in_bytes", "3356341262"),
            ("/sys/fs/cgroup/cpu/picchio/memory.limit_in_bytes", "1"),
        ]);
        let membership = "12:pids:/picchio\n4:cpu,cpuacct:/picchio\n3:memory:/picchio\n0::/\n";
        assert_eq!(limit(membership, &fs), Some(3356341262));
        assert_eq!(limit("3:memory:/\n", &fs), None);
        // Garbage lines are skipped, not trusted.
        assert_eq!(limit("garbage\n3:memory\n", &fs), None);
    }

    #[test]
    fn reports_memory() {
        assert!(super::total_memory().unwrap_or(1) > 0);
        assert!(super::available_memory().unwrap_or(1) > 0);
        assert!(super::peak_rss().unwrap_or(1) > 0);
        assert!(!super::cpu_description().is_empty());
        assert_eq!(super::gib(512), "512 B");
        assert_eq!(super::gib(3 << 20), "3.0 MiB");
        assert_eq!(super::gib(5 << 29), "2.50 GiB");
    }
}
