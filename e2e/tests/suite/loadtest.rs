//! Smoke runs of every `tether-loadtest` scenario with tiny parameters: the binary exits 0, writes
//! a result with the stable JSON schema, and writes its SVG charts. No figure is checked against
//! a threshold: performance is measured by the harness, never asserted in tests.

use std::path::{Path, PathBuf};
use std::process::Command;

use tether_e2e::bins::bin_path;
use tether_loadtest::local::ScratchDir;

/// Runs `tether-loadtest <args>` writing JSON and charts into a scratch directory; returns the
/// parsed result, the chart directory and stdout.
fn run(args: &[&str]) -> (serde_json::Value, ScratchDir, String) {
    let dir = ScratchDir::new("tether-loadtest-smoke").unwrap();
    let json = dir.path().join("result.json");
    let svg = dir.path().join("svg");
    let output = Command::new(bin_path("tether-loadtest"))
        .arg("--quiet")
        .arg("--json")
        .arg(&json)
        .arg("--svg-dir")
        .arg(&svg)
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "tether-loadtest {args:?} failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let text = std::fs::read_to_string(&json).unwrap();
    let result: serde_json::Value = serde_json::from_str(&text).unwrap();
    check_schema(&result, args[0]);
    (result, dir, stdout)
}

/// The fields every result has.
fn check_schema(result: &serde_json::Value, scenario: &str) {
    assert_eq!(result["schema"], "tether-loadtest/1", "{result}");
    assert_eq!(result["scenario"], scenario);
    assert!(result["parameters"].is_object());
    let machine = &result["machine"];
    assert!(machine["nproc"].as_u64().unwrap() >= 1, "{machine}");
    assert!(!machine["kernel"].as_str().unwrap().is_empty());
    assert!(machine["cpu_model"].is_string());
    assert_eq!(machine["load_average_start"].as_array().unwrap().len(), 3);
    for section in ["baseline", "tunnel", "ratios", "figures"] {
        assert!(result[section].is_object(), "{section} missing: {result}");
    }
    assert!(result["series"].is_array());
    assert!(result["elapsed_s"].as_f64().unwrap() > 0.0);
}

/// A positive number at `section.key`.
fn positive(result: &serde_json::Value, section: &str, key: &str) -> f64 {
    let value = result[section][key].as_f64().unwrap_or_else(|| panic!("{section}.{key} missing: {result}"));
    assert!(value > 0.0, "{section}.{key} = {value}");
    value
}

/// The chart exists and is an SVG document.
fn check_svg(dir: &ScratchDir, name: &str) {
    let path: PathBuf = dir.path().join("svg").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(text.starts_with("<svg"), "{name} does not start with <svg");
    assert!(text.trim_end().ends_with("</svg>"), "{name} is not closed");
    assert!(text.contains("<polyline") || text.contains("<rect"), "{name} draws nothing");
}

fn series_named<'a>(result: &'a serde_json::Value, part: &str) -> &'a serde_json::Value {
    result["series"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"].as_str().unwrap_or_default().contains(part))
        .unwrap_or_else(|| panic!("no series named like {part:?}: {}", result["series"]))
}

#[test]
fn throughput_smoke() {
    // Over an emulated 4 ms round trip, so the delayed-link path runs too.
    // With the relay baselines: two relays, plain and with TLS between them, in front of the same
    // (delayed) server.
    let (result, dir, stdout) =
        run(&["throughput", "--duration", "0.5", "--repeat", "1", "--link-delay-ms", "2", "--relay-baseline"]);
    for key in ["download_mib_s", "upload_mib_s"] {
        positive(&result, "baseline", key);
        positive(&result, "tunnel", key);
        positive(&result, "ratios", key);
    }
    for direction in ["download", "upload"] {
        for key in [
            "relay_mib_s",
            "relay_over_direct",
            "tunnel_over_relay",
            "tls_relay_mib_s",
            "tls_relay_over_direct",
            "tunnel_over_tls_relay",
            "tls_relay_cpu_s_per_gib",
            "tunnel_cpu_s_per_gib",
            "direct_cpu_s_per_gib",
        ] {
            positive(&result, "figures", &format!("{direction}_{key}"));
        }
    }
    assert!(series_named(&result, "relay download")["points"].is_array());
    assert!(series_named(&result, "tls_relay upload")["points"].is_array());
    assert!(stdout.contains("two relays, TLS between"), "{stdout}");
    assert_eq!(result["target"], "local");
    assert_eq!(result["parameters"]["link_delay_ms"], 2);
    assert!(series_named(&result, "tunnel download")["points"].is_array());
    assert!(stdout.contains("tunnel/direct"), "{stdout}");
    check_svg(&dir, "throughput.svg");
}

#[test]
fn rps_smoke() {
    let (result, dir, _) =
        run(&["rps", "--connections", "4", "--duration", "0.5", "--repeat", "1", "--relay-baseline"]);
    for key in ["relay_requests_per_s", "relay_over_direct", "tunnel_over_relay", "tunnel_cpu_us_per_request"] {
        positive(&result, "figures", key);
    }
    positive(&result, "baseline", "requests_per_s");
    positive(&result, "tunnel", "requests_per_s");
    positive(&result, "ratios", "requests_per_s");
    positive(&result, "tunnel", "p99_us");
    check_svg(&dir, "rps.svg");
}

#[test]
fn latency_smoke() {
    let (result, dir, _) = run(&["latency", "--rate", "200", "--duration", "0.5", "--repeat", "1"]);
    for key in ["p50_us", "p90_us", "p99_us", "p99.9_us"] {
        positive(&result, "baseline", key);
        positive(&result, "tunnel", key);
        assert!(result["ratios"][format!("{key}_overhead_us")].is_number(), "{result}");
    }
    let distribution = series_named(&result, "tunnel latency distribution");
    assert_eq!(distribution["x_unit"], "percentile");
    check_svg(&dir, "latency.svg");
}

#[test]
fn dial_rate_smoke() {
    let (result, dir, _) = run(&["dial-rate", "--duration", "0.5", "--repeat", "1", "--relay-baseline"]);
    for key in [
        "relay_dials_per_s",
        "relay_over_direct",
        "connect_relay_dials_per_s",
        "connect_relay_over_direct",
        "tunnel_over_connect_relay",
        "tunnel_cpu_us_per_dial",
        "direct_cpu_us_per_dial",
        "connect_relay_no_tunnel_cpu_us_per_dial",
    ] {
        positive(&result, "figures", key);
    }
    // The bare CONNECT relay answers every dial like the frontend does.
    assert_eq!(result["figures"]["connect_relay_no_tunnel_errors"], 0.0, "{result}");
    positive(&result, "baseline", "dials_per_s");
    positive(&result, "tunnel", "dials_per_s");
    positive(&result, "ratios", "dials_per_s");
    positive(&result, "tunnel", "unix_socket_dials_per_s");
    check_svg(&dir, "dial-rate.svg");
}

#[test]
fn agents_smoke() {
    let (result, dir, _) =
        run(&["agents", "--agents", "20", "--concurrency", "10", "--source-ips", "2", "--hold", "0.5"]);
    assert_eq!(result["target"], "processes");
    assert_eq!(result["figures"]["agents_connected"], 20.0, "{result}");
    assert_eq!(result["figures"]["connect_errors"], 0.0);
    assert_eq!(result["figures"]["gateway_registered_sessions"], 20.0);
    assert!(result["figures"]["gateway_rss_per_agent_kib"].is_number());
    positive(&result, "tunnel", "connect_p50_ms");
    check_svg(&dir, "agents-memory.svg");
    check_svg(&dir, "agents-connect.svg");
}

#[test]
fn streams_smoke() {
    let (result, dir, stdout) =
        run(&["streams", "--streams", "40", "--steps", "2", "--concurrency", "8", "--settle", "0.2", "--cycles", "3"]);
    let figures = &result["figures"];
    assert_eq!(figures["streams_open"], 40.0, "{result}");
    assert_eq!(figures["gateway_streams_open_metric"], 40.0);
    assert!(figures["gateway_open_fds"].as_f64().unwrap() >= figures["gateway_open_fds_base"].as_f64().unwrap() + 40.0);
    // After three rounds of opening and closing, nothing is left behind on either side.
    assert_eq!(figures["cycles"], 3.0);
    assert_eq!(figures["gateway_streams_open_after_close"], 0.0, "{result}");
    assert_eq!(figures["agent_streams_open_after_close"], 0.0, "{result}");
    assert_eq!(figures["gateway_open_fds_after_close"], figures["gateway_open_fds_base"], "{result}");
    assert_eq!(figures["agent_open_fds_after_close"], figures["agent_open_fds_base"], "{result}");
    assert!(figures["gateway_rss_growth_kib_per_cycle"].is_number());
    assert_eq!(series_named(&result, "agent RSS after close")["points"].as_array().unwrap().len(), 3);
    assert!(stdout.contains("3 cycles of open + close"), "{stdout}");
    assert!(result["tunnel"]["gateway_kib_per_stream"].is_number());
    assert!(result["tunnel"]["agent_kib_per_stream"].is_number());
    assert_eq!(series_named(&result, "gateway RSS")["points"].as_array().unwrap().len(), 3);
    check_svg(&dir, "streams-memory.svg");
}

#[test]
fn reconnect_smoke() {
    let (result, dir, _) = run(&[
        "reconnect",
        "--agents",
        "10",
        "--source-ips",
        "2",
        "--reconnect-initial",
        "0.1",
        "--reconnect-max",
        "0.5",
        "--timeout",
        "30",
    ]);
    positive(&result, "tunnel", "restart_to_all_agents_back_ms");
    positive(&result, "tunnel", "restart_to_first_dial_ok_ms");
    assert_eq!(result["figures"]["agents"], 10.0);
    check_svg(&dir, "reconnect.svg");
}

#[test]
fn mux_compare_smoke() {
    let (result, dir, _) = run(&[
        "mux-compare",
        "--duration",
        "0.3",
        "--repeat",
        "1",
        "--streams",
        "1,2",
        "--tokio-yamux-windows-kib",
        "256",
    ]);
    positive(&result, "baseline", "direct_1_streams_mib_s");
    positive(&result, "tunnel", "tether_mux_1_streams_mib_s");
    positive(&result, "tunnel", "tether_mux_2_streams_mib_s");
    positive(&result, "tunnel", "yamux_crate_2_streams_mib_s");
    positive(&result, "tunnel", "tokio_yamux_256k_2_streams_mib_s");
    positive(&result, "tunnel", "wss_no_mux_1_streams_mib_s");
    check_svg(&dir, "mux-compare.svg");
}

/// rathole is an optional third-party program; without it the comparison cannot run.
fn rathole() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> =
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()).map(|d| d.join("rathole")).collect();
    if let Some(home) = std::env::var_os("HOME") {
        candidates.push(Path::new(&home).join(".cargo/bin/rathole"));
    }
    candidates.into_iter().find(|p| p.exists())
}

#[test]
fn peer_smoke_against_rathole() {
    let Some(rathole) = rathole() else {
        eprintln!("rathole is not installed (cargo install rathole); skipping the peer comparison");
        return;
    };
    let rathole = rathole.display().to_string();
    let (result, dir, _) =
        run(&["peer", "--rathole-bin", &rathole, "--duration", "0.5", "--dial-duration", "0.5", "--repeat", "1"]);
    positive(&result, "tunnel", "tether_download_mib_s");
    positive(&result, "tunnel", "rathole_download_mib_s");
    positive(&result, "tunnel", "rathole_dials_per_s");
    check_svg(&dir, "peer.svg");
}

#[test]
fn compare_prints_ratios_between_two_results() {
    let dir = ScratchDir::new("tether-loadtest-compare").unwrap();
    let result = |download: f64| {
        serde_json::json!({
            "schema": "tether-loadtest/1", "scenario": "throughput", "target": "local",
            "started_at_unix": 0, "elapsed_s": 1.0, "parameters": {},
            "machine": { "nproc": 2, "kernel": "k", "cpu_model": "c", "mem_total_mib": 1,
                         "load_average_start": [0.0, 0.0, 0.0], "load_average_end": [0.0, 0.0, 0.0] },
            "baseline": { "download_mib_s": 1000.0 }, "tunnel": { "download_mib_s": download },
            "ratios": { "download_mib_s": download / 1000.0 }, "figures": {}, "series": [], "notes": [],
        })
    };
    let a = dir.path().join("a.json");
    let b = dir.path().join("b.json");
    std::fs::write(&a, result(400.0).to_string()).unwrap();
    std::fs::write(&b, result(500.0).to_string()).unwrap();
    let output = Command::new(bin_path("tether-loadtest")).arg("compare").arg(&a).arg(&b).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    let line = stdout.lines().find(|l| l.contains("tunnel.download_mib_s")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("1.250"), "{line}");
}

/// The soak in two minutes: every kind of load at once against the real binaries, a gateway
/// restart half-way and a token rotation at three quarters. What is checked is what a leak would
/// break, never a speed: after the load every stream, forward and extra session is gone on both
/// sides, open files and runtime tasks are back at their baseline, and nothing failed outside the
/// restart.
#[test]
fn soak_returns_to_its_baseline() {
    let (result, dir, stdout) = run(&[
        "soak",
        "--duration",
        "2m",
        "--sample-interval",
        "2s",
        "--dial-rate",
        "20",
        "--forward-rate",
        "10",
        "--bulk-mib",
        "4",
        "--idle-streams",
        "60",
        "--idle-forwards",
        "20",
        "--churn-agents",
        "2",
        "--churn-period",
        "15s",
        "--settle-timeout",
        "60s",
    ]);
    let figures = &result["figures"];
    let figure = |key: &str| figures[key].as_f64().unwrap_or_else(|| panic!("{key} missing: {result}"));
    assert_eq!(figure("settled"), 1.0, "not back at the baseline: {stdout}");
    for side in ["gateway", "agent"] {
        assert_eq!(figure(&format!("{side}_streams_open_end")), 0.0, "{stdout}");
        assert_eq!(figure(&format!("{side}_forwards_open_end")), 0.0, "{stdout}");
        assert_eq!(figure(&format!("{side}_sessions_end")), 1.0, "{stdout}");
        assert_eq!(figure(&format!("{side}_open_fds_end")), figure(&format!("{side}_open_fds_base")), "{stdout}");
        assert!(figure(&format!("{side}_tasks_end")) <= figure(&format!("{side}_tasks_base")), "{stdout}");
        // The load reached both processes.
        assert!(figure(&format!("{side}_streams_open_peak")) >= 60.0, "{stdout}");
        assert!(figure(&format!("{side}_forwards_open_peak")) >= 20.0, "{stdout}");
        assert!(series_named(&result, &format!("{side} rss_kib"))["points"].as_array().unwrap().len() >= 30);
    }
    // Extra agents came and went: the gateway held more than the main agent's session at times.
    assert!(figure("extra_agent_starts") >= 2.0 && figure("extra_agent_stops") == figure("extra_agent_starts"));
    assert!(figure("gateway_sessions_peak") >= 2.0, "{stdout}");
    assert!(figure("extra_agent_dials_ok") > 0.0);
    assert_eq!(figure("gateway_drained_on_sigterm"), 1.0);
    assert_eq!(figure("token_rotation_accepted"), 1.0, "{stdout}");
    for load in ["dials", "forwards", "bulk_transfers", "idle_opens"] {
        assert!(figure(&format!("{load}_ok")) > 0.0, "no {load}: {stdout}");
        assert_eq!(figure(&format!("{load}_failed")), 0.0, "{load} failed outside the restart: {stdout}");
    }
    // Idle streams die only with the gateway that held them.
    assert_eq!(figure("idle_lost_failed"), 0.0, "{stdout}");
    for chart in ["soak-memory.svg", "soak-files.svg", "soak-tasks.svg", "soak-gauges.svg", "soak-load.svg"] {
        check_svg(&dir, chart);
    }
}
