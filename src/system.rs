//! Facts about the machine: physical memory, this process's peak resident memory, the CPU.

/// Total physical memory in bytes, if the platform reports it.
pub fn total_memory() -> Option<u64> {
    let mut sys = sysinfo::System::new().ok()?;
    sys.refresh_memory();
    let total = sys.total_memory();
    (total > 0).then_some(total)
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
