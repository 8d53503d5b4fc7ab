//! Certificates loaded from files, re-read on reload (rotation without a restart), and the
//! check for changed files that triggers a reload.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use tether_tunnel::tls::ReloadableCert;

/// Every live certificate loaded from files.
#[derive(Default)]
pub struct CertRegistry {
    certs: Mutex<Vec<Weak<ReloadableCert>>>,
}

impl CertRegistry {
    /// Remembers a certificate for reloads.
    pub fn register(&self, cert: &Arc<ReloadableCert>) {
        if let Ok(mut certs) = self.certs.lock() {
            certs.retain(|c| c.strong_count() > 0);
            certs.push(Arc::downgrade(cert));
        }
    }

    fn live(&self) -> Vec<Arc<ReloadableCert>> {
        self.certs.lock().map(|c| c.iter().filter_map(Weak::upgrade).collect()).unwrap_or_default()
    }

    /// The certificate and key files of every live certificate.
    pub fn files(&self) -> Vec<PathBuf> {
        self.live().iter().flat_map(|c| c.files().map(Path::to_path_buf)).collect()
    }

    /// Re-reads every live certificate; failures keep the old pair and are returned.
    pub fn reload_all(&self) -> Vec<String> {
        self.live().iter().filter_map(|cert| cert.reload().err().map(|e| e.to_string())).collect()
    }
}

/// What identifies a file's current content cheaply: size, modification time and inode. A
/// Kubernetes ConfigMap or Secret update swaps a symlink, which changes the inode the path
/// leads to; an edit in place changes the time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint(Vec<Option<(u64, i64, i64, u64)>>);

impl Fingerprint {
    /// The fingerprint of `files` (a missing file counts as such). Blocking: call it from a
    /// blocking task.
    pub fn of(files: &[PathBuf]) -> Self {
        Self(
            files
                .iter()
                .map(|f| std::fs::metadata(f).ok().map(|m| (m.len(), m.mtime(), m.mtime_nsec(), m.ino())))
                .collect(),
        )
    }

    /// Whether the first file (the configuration) exists.
    pub fn first_exists(&self) -> bool {
        self.0.first().is_some_and(Option::is_some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_or_replaced_file_changes_the_fingerprint() {
        let dir = std::env::temp_dir().join(format!("tether-fingerprint-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("gateway.yaml");
        std::fs::write(&file, "a: 1\n").unwrap();
        let files = vec![file.clone(), dir.join("missing.crt")];
        let before = Fingerprint::of(&files);
        assert!(before.first_exists());
        assert_eq!(before, Fingerprint::of(&files));
        // Replaced the way a ConfigMap update does it: a new file moved over the path.
        let next = dir.join("gateway.yaml.new");
        std::fs::write(&next, "a: 2\n").unwrap();
        std::fs::rename(&next, &file).unwrap();
        assert_ne!(before, Fingerprint::of(&files));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(!Fingerprint::of(&files).first_exists());
    }
}
