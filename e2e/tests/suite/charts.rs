//! The Helm charts under `helm/`, with the real helm binary: strict lint, rendering with the
//! default values and every `ci/` values file, strict validation of the manifests against two
//! Kubernetes versions, refusal of bad values with a clear message, and the rendered gateway and
//! agent configurations checked by the real binaries (`--check-config --offline`) with the
//! environment the chart gives them, so the charts and the code cannot drift apart.
//!
//! helm and kubernetes-validate come from `scripts/install-test-deps.sh`; without them these tests
//! fail and say so.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use tether_e2e::bins::bin_path;
use tether_e2e::helm::{Tools, all, chart_dir, ci_values, find, repo_root, yaml_files};
use tether_loadtest::local::ScratchDir;

const GATEWAY: &str = "tether-gateway";
const AGENT: &str = "tether-agent";
const RELEASE: &str = "tether";
const NAMESPACE: &str = "tether-system";
/// The newest Kubernetes version the pinned kubernetes-validate knows; every rendering must also
/// validate against its chart's declared minimum (`kubeVersion` in Chart.yaml).
const NEWEST_KUBERNETES: &str = "1.37.0";

/// The minimum Kubernetes version a chart declares (`kubeVersion: ">=1.25.0-0"` -> `1.25.0`).
fn declared_minimum(chart: &str) -> String {
    let text = std::fs::read_to_string(chart_dir(chart).join("Chart.yaml")).unwrap();
    let line = text.lines().find_map(|l| l.strip_prefix("kubeVersion:")).expect("Chart.yaml declares kubeVersion");
    let version = line.trim().trim_matches('"').trim_start_matches(">=").trim_end_matches("-0");
    assert_eq!(version.split('.').count(), 3, "kubeVersion {line:?} is not of the form \">=X.Y.Z-0\"");
    version.to_owned()
}
/// What the chart tests give the downward API's fields.
const NODE_NAME: &str = "node-1";
const HOST_IP: &str = "10.0.0.5";

/// One rendering of a chart.
struct Rendering {
    /// `default` or the values file's stem.
    label: String,
    values: Option<PathBuf>,
    text: String,
    docs: Vec<Value>,
}

/// Renders `chart` with its default values and with every `ci/` values file.
fn render_all(tools: &Tools, chart: &str) -> Vec<Rendering> {
    render_all_for(tools, chart, None)
}

/// Every values file rendered as for a server of `kube_version` (helm's default when `None`).
fn render_all_for(tools: &Tools, chart: &str, kube_version: Option<&str>) -> Vec<Rendering> {
    let mut values: Vec<Option<PathBuf>> = vec![None];
    values.extend(ci_values(chart).into_iter().map(Some));
    assert!(values.len() >= 4, "{chart}: expected at least three ci/ values files");
    values
        .into_iter()
        .map(|values| {
            let label = values
                .as_deref()
                .and_then(Path::file_stem)
                .map_or_else(|| "default".to_owned(), |s| s.to_string_lossy().into_owned());
            let text = tools
                .template(&chart_dir(chart), RELEASE, NAMESPACE, values.as_deref(), kube_version)
                .unwrap_or_else(|e| panic!("{chart} ({label}) does not render:\n{e}"));
            let docs = tools.parse_yaml(&text);
            assert!(!docs.is_empty(), "{chart} ({label}) rendered nothing");
            Rendering { label, values, text, docs }
        })
        .collect()
}

fn rendering<'a>(renderings: &'a [Rendering], label: &str) -> &'a Rendering {
    renderings.iter().find(|r| r.label == label).unwrap_or_else(|| panic!("no rendering {label}"))
}

fn container<'a>(pod_spec: &'a Value, name: &str) -> &'a Value {
    pod_spec["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no container {name} in {pod_spec}"))
}

fn strings(value: &Value) -> Vec<String> {
    value.as_array().map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect()).unwrap_or_default()
}

/// The environment a container gets, with the downward API fields the charts use filled in.
fn container_env(container: &Value) -> Vec<(String, String)> {
    let mut env = Vec::new();
    for var in container["env"].as_array().cloned().unwrap_or_default() {
        let name = var["name"].as_str().expect("env name").to_owned();
        let value = if let Some(value) = var["value"].as_str() {
            value.to_owned()
        } else {
            match var["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("spec.nodeName") => NODE_NAME.to_owned(),
                Some("status.hostIP") => HOST_IP.to_owned(),
                _ => panic!("the chart sets {name} from a source these tests do not model: {var}"),
            }
        };
        env.push((name, value));
    }
    env
}

/// The value under a `--config` argument.
fn config_arg(container: &Value) -> String {
    let args = strings(&container["args"]);
    let at = args.iter().position(|a| a == "--config").expect("--config argument");
    args[at + 1].clone()
}

/// Mount paths of a container.
fn mount_paths(container: &Value) -> Vec<String> {
    container["volumeMounts"]
        .as_array()
        .map(|ms| ms.iter().filter_map(|m| m["mountPath"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

fn is_under(path: &str, dir: &str) -> bool {
    path.strip_prefix(dir.trim_end_matches('/')).is_some_and(|rest| rest.starts_with('/'))
}

/// Every `*_file` value in a configuration (file paths the process opens).
fn file_paths(value: &Value, key: &str, out: &mut Vec<(String, String)>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                let path = if key.is_empty() { k.clone() } else { format!("{key}.{k}") };
                if k.ends_with("_file")
                    && let Some(s) = v.as_str()
                {
                    out.push((path.clone(), s.to_owned()));
                }
                file_paths(v, &path, out);
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                file_paths(v, &format!("{key}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// Asserts that every file the configuration names lies in a directory the container mounts.
fn assert_files_are_mounted(what: &str, config: &Value, mounts: &[String]) {
    let mut files = Vec::new();
    file_paths(config, "", &mut files);
    for (key, path) in files {
        assert!(
            mounts.iter().any(|m| is_under(&path, m)),
            "{what}: {key} = {path} is not inside any mounted directory ({mounts:?})"
        );
    }
}

/// Runs a binary's `--check-config --offline` on `config` with exactly `env` (plus PATH).
fn check_config(
    binary: &str,
    dir: &Path,
    name: &str,
    config: &str,
    env: &[(String, String)],
) -> Result<String, String> {
    let file = dir.join(name);
    std::fs::write(&file, config).expect("write the rendered configuration");
    let mut command = Command::new(bin_path(binary));
    command.args(["--check-config", "--offline", "-c"]).arg(&file).env_clear();
    command.env("PATH", std::env::var_os("PATH").unwrap_or_default());
    for (key, value) in env {
        command.env(key, value);
    }
    let output = command.output().unwrap_or_else(|e| panic!("cannot run {binary}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    if output.status.success() { Ok(text) } else { Err(text) }
}

/// A file a ConfigMap carries.
fn configmap_file(docs: &[Value], name_suffix: &str, key: &str) -> String {
    let cm = find(docs, "ConfigMap", name_suffix).unwrap_or_else(|| panic!("no ConfigMap *{name_suffix}"));
    cm["data"][key].as_str().unwrap_or_else(|| panic!("ConfigMap *{name_suffix} has no {key}")).to_owned()
}

fn parse_one(tools: &Tools, yaml: &str) -> Value {
    let mut docs = tools.parse_yaml(yaml);
    assert_eq!(docs.len(), 1, "expected one YAML document:\n{yaml}");
    docs.remove(0)
}

/// Seconds of a duration as the configuration writes it (`30s`, `1m`, `90`).
fn seconds(text: &str) -> u64 {
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 = number.parse().unwrap_or_else(|_| panic!("not a duration in whole units: {text}"));
    match unit {
        "" | "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        _ => panic!("unexpected duration unit in {text}"),
    }
}

#[test]
fn both_charts_pass_strict_lint_with_every_values_file() {
    let tools = Tools::find();
    for chart in [GATEWAY, AGENT] {
        let mut values: Vec<Option<PathBuf>> = vec![None];
        values.extend(ci_values(chart).into_iter().map(Some));
        for values in values {
            let output = tools
                .lint(&chart_dir(chart), values.as_deref())
                .unwrap_or_else(|e| panic!("helm lint --strict {chart} {values:?} failed:\n{e}"));
            assert!(output.contains("0 chart(s) failed"), "{chart} {values:?}:\n{output}");
        }
    }
}

#[test]
fn rendered_manifests_validate_strictly_against_the_declared_minimum_and_the_newest_kubernetes() {
    let tools = Tools::find();
    let dir = ScratchDir::new("tether-charts-validate").unwrap();
    let mut kinds = BTreeMap::<String, usize>::new();
    for chart in [GATEWAY, AGENT] {
        let minimum = declared_minimum(chart);
        for version in [minimum.as_str(), NEWEST_KUBERNETES] {
            let mut files = Vec::new();
            for r in render_all_for(&tools, chart, Some(version)) {
                let file = dir.path().join(format!("{chart}-{version}-{}.yaml", r.label));
                std::fs::write(&file, &r.text).unwrap();
                files.push(file);
                for doc in &r.docs {
                    *kinds.entry(doc["kind"].as_str().unwrap_or_default().to_owned()).or_default() += 1;
                }
                // The static pod travels inside a ConfigMap: validate the manifest itself too.
                if let Some(cm) = find(&r.docs, "ConfigMap", "-static-pod") {
                    let file = dir.path().join(format!("{chart}-{version}-{}-static-pod.yaml", r.label));
                    let manifest = cm["data"]["tether-agent.yaml"].as_str().expect("static pod manifest");
                    std::fs::write(&file, manifest).unwrap();
                    files.push(file);
                    *kinds.entry("Pod".into()).or_default() += 1;
                }
            }
            // The ServiceMonitor is a custom resource: no Kubernetes schema; its shape is checked below.
            let output = tools.validate(&files, &[version], &["ServiceMonitor"]).unwrap_or_else(|e| {
                panic!("{chart}: kubernetes-validate --strict -k {version} refused the rendered manifests:\n{e}")
            });
            assert!(!output.contains("ERROR"), "{chart} {version}: {output}");
        }
    }
    for kind in [
        "Deployment",
        "DaemonSet",
        "Pod",
        "Service",
        "ConfigMap",
        "ServiceAccount",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Ingress",
        "ServiceMonitor",
    ] {
        assert!(kinds.contains_key(kind), "no {kind} was rendered by any values file: {kinds:?}");
    }
}

#[test]
fn bad_values_are_refused_with_a_clear_message() {
    let tools = Tools::find();
    for chart in [GATEWAY, AGENT] {
        let bad = yaml_files(&repo_root().join("e2e/tests/fixtures/charts").join(chart));
        assert!(bad.len() >= 5, "{chart}: expected bad values fixtures");
        for file in bad {
            let text = std::fs::read_to_string(&file).unwrap();
            let expected: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# expect: ")).collect();
            assert!(!expected.is_empty(), "{} has no '# expect:' line", file.display());
            let error = match tools.template(&chart_dir(chart), RELEASE, NAMESPACE, Some(&file), None) {
                Ok(_) => panic!("{chart} accepted {}", file.display()),
                Err(error) => error,
            };
            for text in expected {
                assert!(error.contains(text), "{}: expected {text:?} in:\n{error}", file.display());
            }
        }
    }
}

#[test]
fn rendered_gateway_configurations_pass_the_gateway_binary_check() {
    let tools = Tools::find();
    let dir = ScratchDir::new("tether-charts-gateway").unwrap();
    let renderings = render_all(&tools, GATEWAY);
    let mut checked = 0;
    for r in &renderings {
        let deployment = find(&r.docs, "Deployment", "").expect("a Deployment");
        let pod = &deployment["spec"]["template"]["spec"];
        let gateway = container(pod, "gateway");
        let env = container_env(gateway);
        let mounts = mount_paths(gateway);
        let config_path = config_arg(gateway);
        let Some(cm) = find(&r.docs, "ConfigMap", "-config") else {
            // An existing configuration: mounted where --config points, nothing rendered.
            assert_eq!(r.label, "existing-secret-values", "only existingConfig renders no configuration");
            let volume = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "config").unwrap();
            assert_eq!(volume["secret"]["secretName"], "tether-gateway-config", "{volume}");
            assert_eq!(config_path, "/etc/tether/config/config.yaml");
            continue;
        };
        let text = cm["data"]["gateway.yaml"].as_str().expect("gateway.yaml");
        let config = parse_one(&tools, text);
        assert!(mounts.iter().any(|m| is_under(&config_path, m)), "{}: --config {config_path} is not mounted", r.label);
        assert_files_are_mounted(&format!("gateway {}", r.label), &config, &mounts);
        for tenant in config["tenants"].as_array().unwrap() {
            if let Some(uds) = tenant["frontend"]["uds"].as_str() {
                assert!(
                    mounts.iter().any(|m| is_under(uds, m)),
                    "{}: socket {uds} is not in a mounted directory",
                    r.label
                );
            }
        }
        // Ports the Deployment exposes are the ones the configuration listens on.
        let ports: Vec<u64> =
            gateway["ports"].as_array().unwrap().iter().filter_map(|p| p["containerPort"].as_u64()).collect();
        let mut listens = vec![
            config["listen"]["agents"].as_str().unwrap().to_owned(),
            config["listen"]["admin"].as_str().unwrap().to_owned(),
        ];
        for tenant in config["tenants"].as_array().unwrap() {
            if let Some(listen) = tenant["frontend"]["tcp"]["listen"].as_str() {
                listens.push(listen.to_owned());
            }
        }
        for section in ["shared_frontend", "peers"] {
            if let Some(listen) = config[section]["listen"].as_str() {
                listens.push(listen.to_owned());
            }
        }
        for listen in &listens {
            let port: u64 = listen.rsplit(':').next().unwrap().parse().unwrap();
            assert!(ports.contains(&port), "{}: {listen} is not a container port ({ports:?})", r.label);
        }
        assert_eq!(ports.len(), listens.len(), "{}: container ports {ports:?} vs listeners {listens:?}", r.label);

        // The defaults carry no tenant: the gateway starts and waits for a reload to add one.
        let ok = check_config("tether-gateway", dir.path(), &format!("{}.yaml", r.label), text, &env)
            .unwrap_or_else(|e| panic!("tether-gateway refused the {} configuration:\n{e}\n{text}", r.label));
        let tenants = config["tenants"].as_array().map_or(0, Vec::len);
        assert!(ok.contains(&format!("configuration OK: {tenants} tenant(s)")), "{ok}");
        checked += 1;
    }
    assert!(checked >= 3, "expected at least three rendered tenant configurations, checked {checked}");
}

#[test]
fn rendered_agent_configurations_pass_the_agent_binary_check() {
    let tools = Tools::find();
    let dir = ScratchDir::new("tether-charts-agent").unwrap();
    // `--offline` checks the rendered paths without requiring the files; that each path is
    // mounted is asserted separately.
    let renderings = render_all(&tools, AGENT);
    let mut checked = 0;
    let mut check = |label: &str, what: &str, text: &str, env: Vec<(String, String)>, config: &Value| {
        let ok = check_config("tether-agent", dir.path(), &format!("{label}-{what}.yaml"), text, &env)
            .unwrap_or_else(|e| panic!("tether-agent refused the {label} {what} configuration:\n{e}\n{text}"));
        let id = config["agent_id"].as_str().unwrap_or(NODE_NAME);
        let url = config["gateway"]["url"].as_str().unwrap();
        assert!(ok.contains(&format!("configuration OK: agent {id} -> {url}")), "{label} {what}: {ok}");
        // Without the chart's environment the kubelet rule has no address to allow.
        if config["allow"].as_array().is_some_and(|rules| rules.iter().any(|r| r["own_addresses"] == true)) {
            let bare: Vec<(String, String)> =
                env.iter().filter(|(k, _)| k != "TETHER__IDENTIFIERS__ADDRESSES").cloned().collect();
            let error = check_config("tether-agent", dir.path(), &format!("{label}-{what}-bare.yaml"), text, &bare)
                .expect_err("own_addresses needs identifiers.addresses from the environment");
            assert!(error.contains("identifiers.addresses is empty"), "{error}");
        }
        checked += 1;
    };
    for r in &renderings {
        // The DaemonSet.
        let ds = find(&r.docs, "DaemonSet", "").expect("a DaemonSet");
        let pod = &ds["spec"]["template"]["spec"];
        let agent = container(pod, "agent");
        let text = configmap_file(&r.docs, "-config", "agent.yaml");
        let config = parse_one(&tools, &text);
        let mounts = mount_paths(agent);
        assert!(mounts.iter().any(|m| is_under(&config_arg(agent), m)), "{}: --config is not mounted", r.label);
        assert_files_are_mounted(&format!("agent {}", r.label), &config, &mounts);
        check(&r.label, "daemonset", &text, container_env(agent), &config);

        // The static pod: its manifest and configuration travel in a ConfigMap.
        if find(&r.docs, "ConfigMap", "-static-pod").is_some() {
            let manifest = configmap_file(&r.docs, "-static-pod", "tether-agent.yaml");
            let pod = parse_one(&tools, &manifest);
            assert_eq!(pod["kind"], "Pod");
            assert!(pod["spec"]["serviceAccountName"].is_null(), "static pods cannot use ServiceAccounts");
            assert!(
                pod["spec"]["volumes"].as_array().unwrap().iter().all(|v| v["hostPath"].is_object()),
                "static pods can only use files on the node: {}",
                pod["spec"]["volumes"]
            );
            let agent = container(&pod["spec"], "agent");
            let text = configmap_file(&r.docs, "-static-pod", "agent.yaml");
            let config = parse_one(&tools, &text);
            let mounts = mount_paths(agent);
            assert!(mounts.iter().any(|m| is_under(&config_arg(agent), m)), "static pod --config is not mounted");
            assert_files_are_mounted(&format!("static pod {}", r.label), &config, &mounts);
            check(&r.label, "static-pod", &text, container_env(agent), &config);
        }

        // The systemd unit: environment from Environment= lines and the per-node agent.env.
        if find(&r.docs, "ConfigMap", "-systemd").is_some() {
            let unit = configmap_file(&r.docs, "-systemd", "tether-agent.service");
            let example = configmap_file(&r.docs, "-systemd", "agent.env.example");
            let text = configmap_file(&r.docs, "-systemd", "agent.yaml");
            let config = parse_one(&tools, &text);
            let exec = unit.lines().find_map(|l| l.strip_prefix("ExecStart=")).expect("ExecStart=");
            let env_file = unit.lines().find_map(|l| l.strip_prefix("EnvironmentFile=")).expect("EnvironmentFile=");
            let host_dir = Path::new(env_file).parent().unwrap().display().to_string();
            assert!(exec.ends_with(&format!("--config {host_dir}/agent.yaml")), "{exec}");
            let mut env: Vec<(String, String)> = unit
                .lines()
                .filter_map(|l| l.strip_prefix("Environment="))
                .chain(example.lines().filter(|l| !l.starts_with('#')))
                .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
                .collect();
            env.sort();
            assert!(env.iter().any(|(k, _)| k == "TETHER__IDENTIFIERS__ADDRESSES"), "agent.env.example: {example}");
            let mut files = Vec::new();
            file_paths(&config, "", &mut files);
            for (key, path) in files {
                assert!(is_under(&path, &host_dir), "systemd: {key} = {path} is outside {host_dir}");
            }
            check(&r.label, "systemd", &text, env, &config);
        }
    }
    assert!(checked >= 6, "expected DaemonSet, static pod and systemd configurations, checked {checked}");
}

#[test]
fn gateway_chart_renders_the_deployment_hosters_need() {
    let tools = Tools::find();
    let renderings = render_all(&tools, GATEWAY);
    for r in &renderings {
        let deployment = find(&r.docs, "Deployment", "").unwrap();
        let pod = &deployment["spec"]["template"]["spec"];
        let gateway = container(pod, "gateway");
        // Probes on the admin port.
        assert_eq!(gateway["livenessProbe"]["httpGet"]["path"], "/healthz", "{}", r.label);
        assert_eq!(gateway["readinessProbe"]["httpGet"]["path"], "/readyz", "{}", r.label);
        assert_eq!(gateway["livenessProbe"]["httpGet"]["port"], "admin");
        assert_eq!(gateway["readinessProbe"]["httpGet"]["port"], "admin");
        // Hardened.
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        assert_eq!(pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
        assert_eq!(gateway["securityContext"]["readOnlyRootFilesystem"], true);
        assert_eq!(gateway["securityContext"]["allowPrivilegeEscalation"], false);
        assert_eq!(strings(&gateway["securityContext"]["capabilities"]["drop"]), ["ALL"]);
        assert_eq!(gateway["image"], "ghcr.io/tether-tunnel/tether-gateway:0.1.0", "tag defaults to appVersion");
        // The pod outlives the drain.
        if let Some(cm) = find(&r.docs, "ConfigMap", "-config") {
            let config = parse_one(&tools, cm["data"]["gateway.yaml"].as_str().unwrap());
            let grace = seconds(config["drain_grace_period"].as_str().unwrap());
            let termination = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
            assert!(
                termination >= grace + 10,
                "{}: terminationGracePeriodSeconds {termination} vs drain {grace}",
                r.label
            );
            // Hot reload by default; a checksum (restarts) only when asked for.
            let checksum = deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"].is_string();
            let restart = r.values.as_ref().is_some_and(|v| {
                std::fs::read_to_string(v).unwrap().lines().any(|l| l.trim() == "restartOnConfigChange: true")
            });
            assert_eq!(checksum, restart, "{}: checksum annotation only with restartOnConfigChange", r.label);
            // The configuration is mounted as a directory, so ConfigMap updates reach the file.
            let mount = gateway["volumeMounts"].as_array().unwrap().iter().find(|m| m["name"] == "config").unwrap();
            assert!(mount["subPath"].is_null(), "{}: a subPath mount never sees ConfigMap updates", r.label);
        }
        // NetworkPolicy on by default: admin port only from scrapers.
        let policy = find(&r.docs, "NetworkPolicy", "").expect("NetworkPolicy on by default");
        assert_eq!(strings(&policy["spec"]["policyTypes"]), ["Ingress", "Egress"]);
        let ingress = policy["spec"]["ingress"].as_array().unwrap();
        let admin_rule = ingress.iter().find(|rule| rule["ports"][0]["port"] == 9090).expect("admin rule");
        assert!(admin_rule["from"].as_array().is_some_and(|f| !f.is_empty()), "the admin port is never open to all");
        let egress = policy["spec"]["egress"].as_array().unwrap();
        assert!(egress.iter().any(|rule| rule["ports"][0]["port"] == 53), "{}: no DNS egress", r.label);
    }

    // Two tenants: each frontend only from its own kube-apiserver pods; egress to the targets.
    let r = rendering(&renderings, "two-tenants-mtls-values");
    let policy = find(&r.docs, "NetworkPolicy", "").unwrap();
    for (port, namespace) in [(8131, "tenant-acme"), (8133, "tenant-globex")] {
        let rule = policy["spec"]["ingress"].as_array().unwrap().iter().find(|rule| rule["ports"][0]["port"] == port);
        let from = &rule.unwrap_or_else(|| panic!("no rule for frontend port {port}"))["from"];
        assert_eq!(from.as_array().unwrap().len(), 1, "{from}");
        assert_eq!(from[0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"], namespace);
        assert_eq!(from[0]["podSelector"]["matchLabels"]["app"], "kube-apiserver");
    }
    let egress = serde_json::to_string(&policy["spec"]["egress"]).unwrap();
    for cidr in ["10.0.12.7/32", "10.96.0.0/12", "10.0.13.9/32", "10.0.13.0/24"] {
        assert!(egress.contains(cidr), "egress lacks {cidr}: {egress}");
    }
    let internal = find(&r.docs, "Service", "-internal").unwrap();
    let internal_ports: Vec<u64> =
        internal["spec"]["ports"].as_array().unwrap().iter().filter_map(|p| p["port"].as_u64()).collect();
    assert_eq!(internal_ports, [9090, 8131, 8133]);
    let public = find(&r.docs, "Service", "-gateway").unwrap();
    assert_eq!(public["spec"]["ports"].as_array().unwrap().len(), 1, "only the agent port is public");
    let monitor = find(&r.docs, "ServiceMonitor", "").expect("ServiceMonitor");
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], "admin");
    assert_eq!(monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/part-of"], "tether-internal");
    assert_eq!(internal["metadata"]["labels"]["app.kubernetes.io/part-of"], "tether-internal");
    let deployment = find(&r.docs, "Deployment", "").unwrap();
    let volumes = serde_json::to_string(&deployment["spec"]["template"]["spec"]["volumes"]).unwrap();
    assert!(volumes.contains("acme-tether") && volumes.contains("globex-tether"), "{volumes}");

    // Ingress: plain HTTP behind it, X-Forwarded-For believed, agents only from the controller.
    let r = rendering(&renderings, "ingress-values");
    let config =
        parse_one(&tools, find(&r.docs, "ConfigMap", "-config").unwrap()["data"]["gateway.yaml"].as_str().unwrap());
    assert!(config["tls"].is_null(), "behind a TLS-terminating ingress the gateway serves plain HTTP");
    assert_eq!(strings(&config["listen"]["trusted_proxies"]), ["10.244.0.0/16"]);
    let ingress = find(&r.docs, "Ingress", "").expect("Ingress");
    let annotations = &ingress["metadata"]["annotations"];
    assert_eq!(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"], "3600");
    assert_eq!(annotations["nginx.ingress.kubernetes.io/proxy-send-timeout"], "3600");
    assert_eq!(annotations["cert-manager.io/cluster-issuer"], "letsencrypt");
    assert_eq!(ingress["spec"]["rules"][0]["host"], "initech.tunnel.example.com");
    assert_eq!(ingress["spec"]["rules"][0]["http"]["paths"][0]["path"], "/v1/tunnel");
    let policy = find(&r.docs, "NetworkPolicy", "").unwrap();
    let agents_rule = &policy["spec"]["ingress"][0];
    assert_eq!(agents_rule["ports"][0]["port"], 8443);
    assert_eq!(
        agents_rule["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
        "ingress-nginx"
    );
    let deployment = find(&r.docs, "Deployment", "").unwrap();
    let volumes = serde_json::to_string(&deployment["spec"]["template"]["spec"]["volumes"]).unwrap();
    assert!(!volumes.contains("\"tls\""), "no gateway certificate behind the ingress: {volumes}");

    // Default: the agent port is open to anywhere, the certificate comes from a TLS Secret.
    let r = rendering(&renderings, "default");
    let policy = find(&r.docs, "NetworkPolicy", "").unwrap();
    assert!(policy["spec"]["ingress"][0]["from"].is_null(), "agents may come from anywhere by default");
    let deployment = find(&r.docs, "Deployment", "").unwrap();
    let tls = deployment["spec"]["template"]["spec"]["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "tls");
    assert_eq!(tls.expect("tls volume")["secret"]["secretName"], "tether-tether-gateway-tls");
    assert!(find(&r.docs, "Service", "-peers").is_none(), "the peers Service is opt-in");
    assert!(all(&r.docs, "Role").is_empty() && all(&r.docs, "ClusterRole").is_empty(), "no RBAC");

    // HA: three replicas spread over nodes, a PDB, the peers Service, a pause before the drain.
    let r = rendering(&renderings, "ha-values");
    let deployment = find(&r.docs, "Deployment", "").unwrap();
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(deployment["spec"]["replicas"], 3);
    assert!(pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"].is_array());
    assert_eq!(pod["topologySpreadConstraints"][0]["topologyKey"], "topology.kubernetes.io/zone");
    assert_eq!(container(pod, "gateway")["lifecycle"]["preStop"]["sleep"]["seconds"], 5);
    assert_eq!(pod["terminationGracePeriodSeconds"], 60 + 15 + 5);
    // Before Kubernetes 1.30 (the sleep action's default-on release) the hook runs the image's sleep.
    let old = render_all_for(&tools, GATEWAY, Some("1.28.0"));
    let old_pod = &find(&rendering(&old, "ha-values").docs, "Deployment", "").unwrap()["spec"]["template"]["spec"];
    let pre_stop = &container(old_pod, "gateway")["lifecycle"]["preStop"];
    assert!(pre_stop.get("sleep").is_none(), "{pre_stop}");
    assert_eq!(pre_stop["exec"]["command"], serde_json::json!(["/bin/sleep", "5"]));
    assert_eq!(find(&r.docs, "PodDisruptionBudget", "").unwrap()["spec"]["maxUnavailable"], 1);
    let peers = find(&r.docs, "Service", "-peers").expect("peers Service");
    assert_eq!(peers["spec"]["clusterIP"], "None");
    assert_eq!(peers["spec"]["publishNotReadyAddresses"], true);
    assert_eq!(peers["spec"]["ports"][0]["port"], 8444);
    let config =
        parse_one(&tools, find(&r.docs, "ConfigMap", "-config").unwrap()["data"]["gateway.yaml"].as_str().unwrap());
    // Replicas find each other through that Service and verify each other's certificate.
    assert_eq!(config["peers"]["dns"], "tether-tether-gateway-peers.tether-system.svc.cluster.local");
    assert_eq!(config["peers"]["listen"], "0.0.0.0:8444");
    assert_eq!(config["peers"]["tls"]["server_name"], "tether-gateway-peer");
    let policy = find(&r.docs, "NetworkPolicy", "").unwrap();
    let peer_in = policy["spec"]["ingress"].as_array().unwrap().iter().find(|rule| rule["ports"][0]["port"] == 8444);
    let peer_in = peer_in.expect("peer port ingress rule");
    assert_eq!(peer_in["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"], "tether-gateway");
    assert!(peer_in["from"][0]["namespaceSelector"].is_null(), "only replicas in the release's namespace");
    let peer_out = policy["spec"]["egress"].as_array().unwrap().iter().find(|rule| rule["ports"][0]["port"] == 8444);
    assert!(peer_out.is_some(), "peer port egress rule");
    assert_eq!(config["listen"]["proxy_protocol"], true);
    assert_eq!(config["shared_frontend"]["listen"], "0.0.0.0:8132");
    let public = find(&r.docs, "Service", "-gateway").unwrap();
    assert_eq!(public["spec"]["type"], "LoadBalancer");
    assert_eq!(public["spec"]["externalTrafficPolicy"], "Local");
}

#[test]
fn agent_chart_renders_a_node_agent_with_least_privilege() {
    let tools = Tools::find();
    let renderings = render_all(&tools, AGENT);
    let script = std::fs::read_to_string(repo_root().join("nodeagent/scripts/setup-host-address.sh")).unwrap();
    for r in &renderings {
        let ds = find(&r.docs, "DaemonSet", "").unwrap();
        let pod = &ds["spec"]["template"]["spec"];
        let agent = container(pod, "agent");
        assert_eq!(pod["hostNetwork"], true, "{}", r.label);
        assert_eq!(pod["priorityClassName"], "system-node-critical");
        assert_eq!(pod["tolerations"][0]["operator"], "Exists");
        assert_eq!(pod["automountServiceAccountToken"], false);
        assert_eq!(pod["serviceAccountName"], "tether-tether-agent");
        // The projected token the gateway checks.
        let token = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "token").unwrap();
        let source = &token["projected"]["sources"][0]["serviceAccountToken"];
        assert_eq!(source["audience"], "tether");
        assert_eq!(source["expirationSeconds"], 3600);
        assert_eq!(source["path"], "token");
        // The identity from the downward API.
        let env = container_env(agent);
        assert!(env.contains(&("NODE_NAME".into(), NODE_NAME.into())), "{env:?}");
        assert!(env.contains(&("TETHER__IDENTIFIERS__ADDRESSES".into(), HOST_IP.into())), "{env:?}");
        // No RBAC at all: the agent calls no Kubernetes API.
        for kind in ["Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"] {
            assert!(all(&r.docs, kind).is_empty(), "{}: the agent needs no {kind}", r.label);
        }
        assert_eq!(agent["securityContext"]["readOnlyRootFilesystem"], true);
        assert_eq!(strings(&agent["securityContext"]["capabilities"]["drop"]), ["ALL"]);
        assert!(agent["securityContext"]["capabilities"]["add"].is_null(), "the agent itself needs no capability");
        // Probes reach the admin endpoint where it listens on the node.
        assert_eq!(agent["livenessProbe"]["httpGet"]["host"], "127.0.0.1");
        assert_eq!(agent["livenessProbe"]["httpGet"]["path"], "/healthz");
        assert_eq!(agent["readinessProbe"]["httpGet"]["path"], "/readyz");
        // Every copy of setup-host-address.sh is the one in nodeagent/scripts.
        for cm in all(&r.docs, "ConfigMap") {
            if let Some(copy) = cm["data"]["setup-host-address.sh"].as_str() {
                assert_eq!(copy, script, "{}: the chart's files/setup-host-address.sh drifted", r.label);
            }
        }
    }

    // Defaults: the kubelet of the node itself, no listener, no init container.
    let r = rendering(&renderings, "default");
    let config =
        parse_one(&tools, find(&r.docs, "ConfigMap", "-config").unwrap()["data"]["agent.yaml"].as_str().unwrap());
    assert_eq!(config["allow"], serde_json::json!([{ "own_addresses": true, "ports": [10250] }]));
    assert!(config["listeners"].is_null(), "node -> control-plane listeners are opt-in");
    let ds = find(&r.docs, "DaemonSet", "").unwrap();
    assert!(ds["spec"]["template"]["spec"]["initContainers"].is_null());
    assert_eq!(ds["spec"]["template"]["spec"]["dnsPolicy"], "ClusterFirstWithHostNet");

    // Proxy with credentials: HTTPS_PROXY/NO_PROXY, the password as a mounted file.
    let r = rendering(&renderings, "proxy-credentials-values");
    let ds = find(&r.docs, "DaemonSet", "").unwrap();
    let pod = &ds["spec"]["template"]["spec"];
    let env = container_env(container(pod, "agent"));
    assert!(env.contains(&("HTTPS_PROXY".into(), "http://proxy.corp.example:3128".into())), "{env:?}");
    assert!(env.contains(&("NO_PROXY".into(), ".cluster.local,10.0.0.0/8".into())), "{env:?}");
    assert!(!env.iter().any(|(k, _)| k.contains("PASSWORD")), "the password never goes into the environment");
    let config =
        parse_one(&tools, find(&r.docs, "ConfigMap", "-config").unwrap()["data"]["agent.yaml"].as_str().unwrap());
    assert_eq!(config["gateway"]["proxy"]["username"], "tether");
    assert_eq!(config["gateway"]["proxy"]["password_file"], "/etc/tether/proxy/password");
    assert_eq!(config["gateway"]["proxy"]["connect_timeout"], "5s", "verbatim config merges under the chart's keys");
    assert_eq!(config["gateway"]["ca_file"], "/etc/tether/ca/ca.crt");
    let password = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "proxy-password").unwrap();
    assert_eq!(password["secret"]["secretName"], "corp-proxy");
    let ca = find(&r.docs, "ConfigMap", "-ca").expect("CA ConfigMap from gateway.ca.pem");
    assert!(ca["data"]["ca.crt"].as_str().unwrap().starts_with("-----BEGIN CERTIFICATE-----"));

    // Node -> control plane: listener and the host-scoped address from an init container.
    let r = rendering(&renderings, "node-to-controlplane-values");
    let config =
        parse_one(&tools, find(&r.docs, "ConfigMap", "-config").unwrap()["data"]["agent.yaml"].as_str().unwrap());
    assert_eq!(config["listeners"], serde_json::json!([{ "bind": "100.64.0.1:6443", "target": "kube-apiserver" }]));
    let ds = find(&r.docs, "DaemonSet", "").unwrap();
    let init = &ds["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(strings(&init["securityContext"]["capabilities"]["add"]), ["NET_ADMIN"]);
    assert_eq!(strings(&init["securityContext"]["capabilities"]["drop"]), ["ALL"]);
    assert_eq!(strings(&init["command"])[1..], ["/opt/tether/setup-host-address.sh", "100.64.0.1", "tether0"]);
    assert!(find(&r.docs, "ConfigMap", "-host-address").is_some());

    // Before the kubelet: a static pod and a systemd unit, each with its own configuration.
    let r = rendering(&renderings, "static-pod-systemd-values");
    for (suffix, token) in [("-static-pod", "/etc/tether/token"), ("-systemd", "/etc/tether/token")] {
        let cm = find(&r.docs, "ConfigMap", suffix).unwrap_or_else(|| panic!("ConfigMap *{suffix}"));
        let config = parse_one(&tools, cm["data"]["agent.yaml"].as_str().unwrap());
        assert_eq!(config["gateway"]["token_file"], token, "{suffix}: a token the hoster provisions");
        assert_eq!(cm["data"]["setup-host-address.sh"].as_str().unwrap(), script);
    }
    let unit =
        find(&r.docs, "ConfigMap", "-systemd").unwrap()["data"]["tether-agent.service"].as_str().unwrap().to_owned();
    assert!(unit.contains("Before=kubelet.service"), "{unit}");
    assert!(unit.contains("ExecStartPre=+/bin/sh /etc/tether/setup-host-address.sh 100.64.0.1 tether0"), "{unit}");
    assert!(unit.contains("Environment=HTTPS_PROXY=http://proxy.corp.example:3128"), "{unit}");
}

#[test]
fn tool_versions_are_the_ones_documented() {
    let tools = Tools::find();
    let helm = tools.helm_version();
    assert!(helm.starts_with("v3.") || helm.starts_with("v4."), "helm {helm}: the charts need helm 3 or 4");
    let validate = tools.kubernetes_validate_version();
    let major_minor: Vec<u32> = validate.split('.').take(2).filter_map(|p| p.parse().ok()).collect();
    assert!(
        major_minor.len() == 2 && (major_minor[0], major_minor[1]) >= (1, 37),
        "kubernetes-validate {validate} cannot validate against Kubernetes {NEWEST_KUBERNETES}"
    );
}
