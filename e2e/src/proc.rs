//! Process resources from /proc: open file descriptors, threads, resident memory.

/// Open file descriptors of a process (`self` for this one).
pub fn open_fds(pid: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or_default()
}

/// Resident set size in KiB.
pub fn rss_kib(pid: &str) -> u64 {
    status_field(pid, "VmRSS:")
}

/// Threads of a process.
pub fn threads(pid: &str) -> u64 {
    status_field(pid, "Threads:")
}

fn status_field(pid: &str, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or_default()
}
