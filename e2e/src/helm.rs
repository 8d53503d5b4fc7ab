//! The Helm charts under test: finding `helm` and `kubernetes-validate` (installed by
//! `scripts/install-test-deps.sh`), rendering a chart, reading the rendered manifests, and
//! validating them against Kubernetes' schemas offline.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// What to run when a tool is missing.
const INSTALL_HINT: &str = "run scripts/install-test-deps.sh (it installs helm and kubernetes-validate into \
     ${TETHER_TOOLS_DIR:-$HOME/.cache/tether-tools}/bin)";

/// Where `scripts/install-helm.sh` and `scripts/install-test-deps.sh` put their tools.
pub fn tools_dir() -> PathBuf {
    match std::env::var_os("TETHER_TOOLS_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tether-tools"),
    }
}

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("e2e/ has a parent").to_path_buf()
}

/// `helm/<name>` in the repository.
pub fn chart_dir(name: &str) -> PathBuf {
    repo_root().join("helm").join(name)
}

/// The chart's representative values files, `helm/<name>/ci/*.yaml`, sorted.
pub fn ci_values(name: &str) -> Vec<PathBuf> {
    yaml_files(&chart_dir(name).join("ci"))
}

/// The `*.yaml` files of a directory, sorted; empty if it does not exist.
pub fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| entries.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default();
    files.retain(|p| p.extension().is_some_and(|e| e == "yaml"));
    files.sort();
    files
}

/// The external programs the chart tests drive.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The helm binary.
    pub helm: PathBuf,
    /// The kubernetes-validate console script.
    pub kubernetes_validate: PathBuf,
    /// A Python with PyYAML (the one kubernetes-validate runs on), to read rendered YAML.
    pub python: PathBuf,
}

impl Tools {
    /// Finds the tools in the tools directory, then in `PATH`. Panics with the fix when one is
    /// missing: the chart tests fail rather than skip.
    pub fn find() -> Self {
        let helm = find_tool("helm")
            .unwrap_or_else(|| panic!("helm is not installed (looked in {} and PATH): {INSTALL_HINT}", bin_dir_text()));
        let kubernetes_validate = find_tool("kubernetes-validate").unwrap_or_else(|| {
            panic!("kubernetes-validate is not installed (looked in {} and PATH): {INSTALL_HINT}", bin_dir_text())
        });
        let python = python_of(&kubernetes_validate).unwrap_or_else(|| {
            panic!("cannot tell which Python runs {}: {INSTALL_HINT}", kubernetes_validate.display())
        });
        Self { helm, kubernetes_validate, python }
    }

    /// `helm version --short`.
    pub fn helm_version(&self) -> String {
        let output = run(Command::new(&self.helm).args(["version", "--short"]));
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// `kubernetes-validate --version`.
    pub fn kubernetes_validate_version(&self) -> String {
        let output = run(Command::new(&self.kubernetes_validate).arg("--version"));
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// `helm lint --strict` with an optional values file; `Err` carries helm's output.
    pub fn lint(&self, chart: &Path, values: Option<&Path>) -> Result<String, String> {
        let mut command = Command::new(&self.helm);
        command.arg("lint").arg("--strict").arg(chart);
        if let Some(values) = values {
            command.arg("--values").arg(values);
        }
        outcome(&run(&mut command))
    }

    /// `helm template` as release `release` in `namespace`; `Err` carries helm's error output.
    pub fn template(
        &self,
        chart: &Path,
        release: &str,
        namespace: &str,
        values: Option<&Path>,
        kube_version: Option<&str>,
    ) -> Result<String, String> {
        let mut command = Command::new(&self.helm);
        command.args(["template", release]).arg(chart).args(["--namespace", namespace]);
        if let Some(version) = kube_version {
            // What `.Capabilities.KubeVersion` says while rendering, as on a server of that version.
            command.args(["--kube-version", version]);
        }
        if let Some(values) = values {
            command.arg("--values").arg(values);
        }
        outcome(&run(&mut command))
    }

    /// The documents of a YAML stream as JSON values (empty documents dropped), read with PyYAML,
    /// the YAML 1.1 reader kubectl's own semantics follow.
    pub fn parse_yaml(&self, yaml: &str) -> Vec<Value> {
        use std::io::Write as _;
        let script = "import json, sys, yaml\n\
                      docs = [d for d in yaml.safe_load_all(sys.stdin) if d is not None]\n\
                      json.dump(docs, sys.stdout)\n";
        let mut child = Command::new(&self.python)
            .args(["-c", script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.python.display()));
        child.stdin.take().expect("stdin").write_all(yaml.as_bytes()).expect("write YAML to python");
        let output = child.wait_with_output().expect("python output");
        assert!(
            output.status.success(),
            "rendered YAML does not parse: {}\n{yaml}",
            String::from_utf8_lossy(&output.stderr)
        );
        match serde_json::from_slice(&output.stdout).expect("python printed JSON") {
            Value::Array(docs) => docs,
            other => panic!("expected a list of documents, got {other}"),
        }
    }

    /// Runs `kubernetes-validate --strict` on `files` for every version. `Ok` carries the output;
    /// `Err` carries it when a manifest did not validate, or when a kind has no schema other than
    /// those in `unknown_kinds_allowed` (custom resources such as a ServiceMonitor).
    pub fn validate(
        &self,
        files: &[PathBuf],
        versions: &[&str],
        unknown_kinds_allowed: &[&str],
    ) -> Result<String, String> {
        let mut command = Command::new(&self.kubernetes_validate);
        command.arg("--strict").arg("--quiet");
        for version in versions {
            command.args(["-k", version]);
        }
        command.args(files);
        let output = run(&mut command);
        let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        let unexpected: Vec<&str> = text
            .lines()
            .filter(|line| {
                let warning_ok = line.starts_with("WARN")
                    && unknown_kinds_allowed.iter().any(|kind| line.contains(&format!("kind {kind} ")));
                !line.trim().is_empty() && !line.starts_with("INFO") && !warning_ok
            })
            .collect();
        if output.status.success() && unexpected.is_empty() { Ok(text) } else { Err(text) }
    }
}

/// The rendered object of `kind` whose name ends with `name_suffix`.
pub fn find<'a>(docs: &'a [Value], kind: &str, name_suffix: &str) -> Option<&'a Value> {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"].as_str().is_some_and(|name| name.ends_with(name_suffix)))
}

/// Every rendered object of `kind`.
pub fn all<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn bin_dir_text() -> String {
    tools_dir().join("bin").display().to_string()
}

fn find_tool(name: &str) -> Option<PathBuf> {
    let local = tools_dir().join("bin").join(name);
    if is_executable(&local) {
        return Some(local);
    }
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join(name))
        .find(|path| is_executable(path))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The Python a console script runs on: the interpreter in its `#!` line (pip writes the one
/// that has its packages), else the `python3` beside it (a virtualenv's bin directory).
fn python_of(script: &Path) -> Option<PathBuf> {
    let text = std::fs::read(script).ok()?;
    let first = text.split(|b| *b == b'\n').next()?;
    let shebang = std::str::from_utf8(first)
        .ok()
        .and_then(|line| line.strip_prefix("#!"))
        .and_then(|line| line.split_whitespace().next())
        .map(PathBuf::from)
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("python")) && is_executable(p));
    shebang.or_else(|| {
        let dir = std::fs::canonicalize(script).ok()?.parent()?.to_path_buf();
        ["python3", "python"].iter().map(|n| dir.join(n)).find(|p| is_executable(p))
    })
}

fn run(command: &mut Command) -> Output {
    command.output().unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"))
}

fn outcome(output: &Output) -> Result<String, String> {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if output.status.success() {
        Ok(stdout)
    } else {
        Err(format!("{}{stdout}", String::from_utf8_lossy(&output.stderr)))
    }
}
