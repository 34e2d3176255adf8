//! The host daemon end to end: tenants started with `memtide run --host` share its DRAM by
//! activeness (the busy one gets more, nobody drops below its minimum, the quotas never exceed
//! the budget), a tenant that exits releases its share at once, tenants carry on when the daemon
//! dies and register again when it returns, only admins see and change other tenants, bad
//! messages never stop the daemon, and a real Prometheus scrapes its metrics.

mod common;

use std::io::{BufRead, BufReader, Read, Write};

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{memtide, require, Scratch, Server};

const MIB: u64 = 1 << 20;

/// A daemon on a socket in `dir`, with metrics on a free port; stopped when dropped.
struct Daemon {
    server: Server,
    socket: PathBuf,
    metrics: u16,
    /// What it has logged so far.
    log: Arc<Mutex<Vec<String>>>,
}

fn start_daemon(dir: &Path, budget: &str, extra: &[&str]) -> Daemon {
    start_daemon_with(dir, budget, extra, None)
}

/// [`start_daemon`], with at most `files` open file descriptors if given.
fn start_daemon_with(dir: &Path, budget: &str, extra: &[&str], files: Option<u64>) -> Daemon {
    let socket = dir.join("host.sock");
    let port = common::free_port();
    let mut cmd = memtide();
    if let Some(n) = files {
        // SAFETY: setrlimit is async-signal-safe and touches only the child.
        unsafe {
            cmd.pre_exec(move || {
                let r = libc::rlimit {
                    rlim_cur: n,
                    rlim_max: n,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        };
    }
    let child = cmd
        .args(["host", "--dram", budget, "--tier"])
        .arg(dir)
        .arg("--socket")
        .arg(&socket)
        .args([
            "--metrics",
            &format!("127.0.0.1:{port}"),
            "--epoch",
            "500ms",
        ])
        .args(extra)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = Server(child);
    // The daemon says where it listens once it does.
    let mut err = BufReader::new(server.0.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert!(line.contains("sharing"), "daemon did not start: {line}");
    // Keep draining its log so it never blocks on a full pipe; echo it for failures.
    let log = Arc::new(Mutex::new(vec![line]));
    let kept = log.clone();
    std::thread::spawn(move || {
        for l in err.lines().map_while(Result::ok) {
            eprintln!("[daemon] {}", l.escape_debug());
            kept.lock().unwrap().push(l);
        }
    });
    Daemon {
        server,
        socket,
        metrics: port,
        log,
    }
}

fn status(socket: &Path) -> serde_json::Value {
    let o = memtide()
        .args(["status", "--json", "--socket"])
        .arg(socket)
        .output()
        .unwrap();
    assert!(o.status.success(), "status: {}", common::stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn tenant<'a>(s: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    s["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
}

/// A tenant running the built-in workload.
fn workload_tenant(socket: &Path, name: &str, min: &str, workload: &[&str]) -> Child {
    workload_tenant_with(socket, name, min, &[], workload)
}

/// [`workload_tenant`] with more options for `memtide run`.
fn workload_tenant_with(
    socket: &Path,
    name: &str,
    min: &str,
    run: &[&str],
    workload: &[&str],
) -> Child {
    memtide()
        .arg("run")
        .arg(format!("--host={}", socket.display()))
        .args(["--name", name, "--dram", min, "-q"])
        .args(run)
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_memtide"))
        .arg("workload")
        .args(workload)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for a tenant and checks it exited 0 with its data intact.
fn finished_clean(child: Child, what: &str) -> String {
    let o = child.wait_with_output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{what} failed: {err}");
    assert!(
        out.contains("\"mismatches\":0"),
        "{what} lost data: {out}\n{err}"
    );
    err
}

fn check_quotas(s: &serde_json::Value, budget: u64) {
    let quotas: Vec<(u64, u64)> = s["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["quota_bytes"].as_u64().unwrap(),
                t["min_bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    let sum: u64 = quotas.iter().map(|q| q.0).sum();
    assert!(
        sum <= budget,
        "quotas {quotas:?} exceed the budget {budget}"
    );
    for (q, min) in quotas {
        assert!(q >= min, "a quota {q} below its minimum {min}");
    }
}

#[test]
fn busy_tenant_gets_the_dram_and_a_leaving_one_releases_it() {
    let dir = Scratch::new("host-share");
    let d = start_daemon(dir.path(), "1GiB", &[]);
    let budget = 1 << 30;
    // Both tenants hold 768 MiB; one is busy over 60% of it, the other idles over 5%.
    let busy = workload_tenant(
        &d.socket,
        "busy",
        "128MiB",
        &[
            "--footprint",
            "768MiB",
            "--hot",
            "60%",
            "--hot-share",
            "100%",
            "--seconds",
            "30",
        ],
    );
    let idle = workload_tenant(
        &d.socket,
        "idle",
        "128MiB",
        &[
            "--footprint",
            "768MiB",
            "--hot",
            "5%",
            "--hot-share",
            "100%",
            "--seconds",
            "30",
            "--rate",
            "20000",
        ],
    );
    let t0 = Instant::now();
    let mut shifted = None;
    while t0.elapsed() < Duration::from_secs(28) {
        std::thread::sleep(Duration::from_millis(250));
        let s = status(&d.socket);
        check_quotas(&s, budget);
        let (Some(b), Some(i)) = (tenant(&s, "busy"), tenant(&s, "idle")) else {
            continue;
        };
        let (qb, qi) = (
            b["quota_bytes"].as_u64().unwrap(),
            i["quota_bytes"].as_u64().unwrap(),
        );
        if qb >= qi + 256 * MIB && b["report"]["active_bytes"].as_u64().unwrap() > 200 * MIB {
            shifted = Some((t0.elapsed(), qb, qi));
            break;
        }
    }
    let (after, qb, qi) = shifted.expect("the busy tenant never got most of the DRAM");
    eprintln!(
        "after {:.1} s: busy {} MiB, idle {} MiB",
        after.as_secs_f64(),
        qb / MIB,
        qi / MIB
    );
    // The idle one still has its minimum and its active memory.
    assert!(qi >= 128 * MIB);
    finished_clean(idle, "idle tenant");
    // Its share goes back at once (the connection closed).
    let t1 = Instant::now();
    loop {
        let s = status(&d.socket);
        check_quotas(&s, budget);
        if tenant(&s, "idle").is_none() {
            break;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(3),
            "an exited tenant is still listed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    finished_clean(busy, "busy tenant");
    let s = status(&d.socket);
    assert_eq!(s["tenants"].as_array().unwrap().len(), 0);
    drop(d);
}

/// The tier shares the status gives, their sum, and what the tenants hold in their tiers.
fn tier_use(s: &serde_json::Value) -> (u64, Vec<(String, u64, u64)>) {
    let rows: Vec<(String, u64, u64)> = s["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_string(),
                t["tier_share_bytes"].as_u64().unwrap(),
                t["report"]["tier_bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    (rows.iter().map(|r| r.1).sum(), rows)
}

#[test]
fn tenants_share_the_tier_capacity_and_keep_within_it() {
    let dir = Scratch::new("host-tier");
    // Two tenants of 256 MiB each in 256 MiB of DRAM and 320 MiB of tier: alone, the first
    // may take the whole tier; with two, each needs a part of it.
    let capacity = 320 * MIB;
    let d = start_daemon(dir.path(), "256MiB", &["--tier-size", "320MiB"]);
    let args = |seconds: &'static str| {
        [
            "--footprint",
            "256MiB",
            "--hot",
            "30%",
            "--seconds",
            seconds,
            "--rate",
            "100000",
        ]
    };
    // The file's capacity is what is shared: the tenants keep no compressed pool.
    let off = ["--compress", "off"];
    let first = workload_tenant_with(&d.socket, "first", "64MiB", &off, &args("24"));
    // The first tenant alone may take the whole tier; wait until it holds a good part of it.
    let t0 = Instant::now();
    loop {
        let s = status(&d.socket);
        if tenant(&s, "first").is_some_and(|t| t["report"]["tier_bytes"].as_u64() > Some(128 * MIB))
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the first tenant never used its tier: {s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let second = workload_tenant_with(&d.socket, "second", "64MiB", &off, &args("12"));
    let mut samples = 0;
    let mut second_used = 0;
    let mut worst = (0u64, String::new());
    while samples < 80 {
        std::thread::sleep(Duration::from_millis(200));
        let s = status(&d.socket);
        let (shares, rows) = tier_use(&s);
        if rows.len() < 2 {
            if samples > 0 {
                break;
            }
            continue;
        }
        samples += 1;
        assert!(
            shares <= capacity,
            "tier shares {rows:?} exceed the capacity"
        );
        let used: u64 = rows.iter().map(|r| r.2).sum();
        if used > worst.0 {
            worst = (used, format!("{rows:?}"));
        }
        second_used = second_used.max(rows.iter().find(|r| r.0 == "second").unwrap().2);
    }
    eprintln!(
        "{samples} samples; most tier in use {} MiB ({}), the second tenant's peak {} MiB",
        worst.0 / MIB,
        worst.1,
        second_used / MIB
    );
    assert!(samples >= 10, "too few samples with both tenants");
    // What the tenants hold in their tiers stays within the capacity (the reports are a
    // fraction of a second apart: a little slack).
    assert!(
        worst.0 <= capacity + 8 * MIB,
        "tiers hold {} MiB of a {} MiB capacity: {}",
        worst.0 / MIB,
        capacity / MIB,
        worst.1
    );
    assert!(
        second_used >= 64 * MIB,
        "the second tenant got no tier to speak of ({} MiB)",
        second_used / MIB
    );
    finished_clean(second, "second tenant");
    finished_clean(first, "first tenant");
    drop(d);
}

#[test]
fn tenants_keep_their_quota_while_the_daemon_is_away() {
    let dir = Scratch::new("host-away");
    let d = start_daemon(dir.path(), "512MiB", &[]);
    let t = workload_tenant(
        &d.socket,
        "steady",
        "256MiB",
        &["--footprint", "384MiB", "--hot", "20%", "--seconds", "12"],
    );
    let t0 = Instant::now();
    while tenant(&status(&d.socket), "steady").is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "tenant never registered"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let socket = d.socket.clone();
    // SIGKILL: no goodbye to anyone.
    let mut server = d.server;
    server.0.kill().unwrap();
    let _ = server.0.wait();
    std::thread::sleep(Duration::from_secs(2));
    let d2 = start_daemon(dir.path(), "512MiB", &[]);
    assert_eq!(d2.socket, socket);
    let t1 = Instant::now();
    while tenant(&status(&d2.socket), "steady").is_none() {
        assert!(
            t1.elapsed() < Duration::from_secs(8),
            "the tenant did not register again with the new daemon"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let err = finished_clean(t, "tenant across a daemon restart");
    assert!(err.contains("lost the host daemon"), "{err}");
    assert!(err.contains("is back"), "{err}");
}

/// Sends raw lines to the daemon as another user (nobody, in the socket's group) and returns
/// the answers, one per line.
fn as_nobody(socket: &Path, lines: &[String]) -> Vec<serde_json::Value> {
    let script = "import socket,sys\n\
        s=socket.socket(socket.AF_UNIX);s.connect(sys.argv[1]);f=s.makefile('rwb')\n\
        for l in sys.stdin.buffer:\n    f.write(l);f.flush();print(f.readline().decode().strip(),flush=True)\n";
    // Debian's python3: nobody cannot run one installed under root's home.
    let input = socket.with_file_name("client-input");
    std::fs::write(
        &input,
        lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();
    let o = Command::new("setpriv")
        .args([
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            script,
        ])
        .arg(socket)
        .stdin(std::fs::File::open(&input).unwrap())
        .output()
        .unwrap();
    assert!(o.status.success(), "client: {}", common::stderr(&o));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|_| panic!("not JSON: {l}")))
        .collect()
}

#[test]
fn only_admins_see_and_change_other_tenants_and_bad_messages_are_harmless() {
    require("/usr/bin/python3");
    require("setpriv");
    let dir = Scratch::new("host-access");
    // The group nobody's client runs in may connect; the directory must let it reach the socket.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let d = start_daemon(dir.path(), "512MiB", &["--group", "nogroup"]);
    let mode = std::fs::metadata(&d.socket).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
        0o660
    );
    let root_tenant = workload_tenant(
        &d.socket,
        "roots",
        "128MiB",
        &["--footprint", "64MiB", "--seconds", "8"],
    );
    let t0 = Instant::now();
    let id = loop {
        if let Some(t) = tenant(&status(&d.socket), "roots") {
            break t["tenant"].as_u64().unwrap();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "tenant never registered"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let big = format!("{{\"status\": \"{}\"}}", "x".repeat(2 << 20));
    let answers = as_nobody(
        &d.socket,
        &[
            "\"status\"".into(),
            format!("{{\"set\": {{\"tenant\": {id}, \"min_bytes\": 1}}}}"),
            "{\"register\": 5}".into(),
            "not json at all".into(),
            big,
            "{\"register\": {\"name\": \"greedy\", \"pid\": 1, \"min_bytes\": 1099511627776}}"
                .into(),
            "{\"register\": {\"name\": \"mine\", \"pid\": 1, \"min_bytes\": 67108864}}".into(),
            "{\"set\": {\"min_bytes\": 134217728}}".into(),
            "\"status\"".into(),
        ],
    );
    assert_eq!(answers.len(), 9, "{answers:?}");
    assert_eq!(
        answers[0]["status"]["tenants"].as_array().unwrap().len(),
        0,
        "another user's client sees no one else's tenant: {}",
        answers[0]
    );
    let refused = |a: &serde_json::Value, needle: &str| {
        let m = a["error"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("{a}"));
        assert!(m.contains(needle), "{needle:?} not in {m:?}");
    };
    refused(&answers[1], "not allowed");
    refused(&answers[2], "malformed");
    refused(&answers[3], "malformed");
    refused(&answers[4], "longer than");
    refused(&answers[5], "cannot guarantee");
    assert!(
        answers[6]["registered"]["tenant"].as_u64().is_some(),
        "{}",
        answers[6]
    );
    assert_eq!(answers[7], serde_json::json!("done"));
    let own = answers[8]["status"]["tenants"].as_array().unwrap();
    assert_eq!(own.len(), 1, "{}", answers[8]);
    assert_eq!(own[0]["name"], "mine");
    assert_eq!(own[0]["min_bytes"], 128 * MIB);
    assert_eq!(own[0]["uid"], 65534);
    // The root tenant was not changed, and the daemon still serves; nobody's tenant left with
    // its connection.
    let s = status(&d.socket);
    assert_eq!(tenant(&s, "roots").unwrap()["min_bytes"], 128 * MIB);
    assert!(tenant(&s, "mine").is_none(), "{s}");
    finished_clean(root_tenant, "root's tenant");
}

/// One HTTP GET on loopback; returns the body.
fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.").then(|| body.to_string())
}

#[test]
fn prometheus_scrapes_the_daemon() {
    require("prometheus");
    let dir = Scratch::new("host-prometheus");
    let d = start_daemon(dir.path(), "512MiB", &[]);
    let t = workload_tenant(
        &d.socket,
        "scraped",
        "64MiB",
        &["--footprint", "256MiB", "--hot", "20%", "--seconds", "25"],
    );
    let prom_port = common::free_port();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: memtide\n    static_configs:\n      - targets: ['127.0.0.1:{}']\n",
            d.metrics
        ),
    )
    .unwrap();
    let _prom = Server(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    common::wait_for_port(prom_port, Duration::from_secs(30));
    let query = |q: &str| -> Vec<serde_json::Value> {
        http_get(prom_port, &format!("/api/v1/query?query={q}"))
            .and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok())
            .and_then(|v| v["data"]["result"].as_array().cloned())
            .unwrap_or_default()
    };
    let t0 = Instant::now();
    let (quota, faults) = loop {
        let q = query("memtide_tenant_quota_bytes");
        let f = query("memtide_tenant_faults_total");
        let h = query("memtide_tenant_tier_read_latency_seconds_count");
        if q.len() == 1 && f.len() == 5 && h.len() == 1 {
            let zero = f
                .iter()
                .find(|r| r["metric"]["kind"] == "zero")
                .map(|r| r["value"][1].as_str().unwrap().parse::<f64>().unwrap())
                .unwrap();
            if zero > 0.0 {
                break (q[0].clone(), zero);
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "Prometheus never had the tenant's metrics"
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(quota["metric"]["tenant"], "scraped");
    let q: f64 = quota["value"][1].as_str().unwrap().parse().unwrap();
    assert!(
        (64.0 * MIB as f64..=512.0 * MIB as f64).contains(&q),
        "quota {q} outside minimum..budget"
    );
    assert!(faults > 0.0);
    let budget = query("memtide_host_dram_budget_bytes");
    assert_eq!(budget[0]["value"][1], "536870912");
    // Every query of the Grafana dashboard in the repository is one Prometheus accepts.
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/grafana-dashboard.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let mut exprs = 0;
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let enc: String = expr
                .bytes()
                .map(|b| match b {
                    b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'.' => {
                        (b as char).to_string()
                    }
                    _ => format!("%{b:02X}"),
                })
                .collect();
            let body = http_get(prom_port, &format!("/api/v1/query?query={enc}")).unwrap();
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["status"], "success", "Grafana query {expr}: {body}");
            exprs += 1;
        }
    }
    assert!(exprs >= 10);
    finished_clean(t, "scraped tenant");
}

#[test]
fn bad_host_input_gets_one_line() {
    common::fails_with(
        &["status", "--socket", "/nonexistent/host.sock"],
        "cannot reach the memtide host daemon",
    );
    common::fails_with(
        &["top", "--socket", "/nonexistent/host.sock"],
        "needs a terminal",
    );
    common::fails_with(
        &["run", "--host=/nonexistent/host.sock", "--", "true"],
        "cannot reach the memtide host daemon",
    );
    common::fails_with(&["host", "--dram", "100000GiB"], "more than this machine");
    common::fails_with(
        &["host", "--dram", "1GiB", "--ratio", "2"],
        "not a DRAM:tier ratio",
    );
    common::fails_with(
        &["host", "--dram", "1GiB", "--tier", "/nonexistent"],
        "not a directory",
    );
    common::fails_with(
        &["host", "--dram", "1GiB", "--metrics", "nowhere"],
        "expected an address",
    );
    common::fails_with(
        &["host", "--dram", "1GiB", "--epoch", "1e30"],
        "--epoch: too long a time",
    );
    common::fails_with(
        &["host", "--dram", "1GiB", "--http-view", "all"],
        "expected tenants or host",
    );
    common::fails_with(
        &["host", "--dram", "1GiB", "--tenant-timeout", "500ms"],
        "--tenant-timeout: at least 1s",
    );
    let dir = Scratch::new("host-bad");
    let d = start_daemon(dir.path(), "256MiB", &[]);
    // A second daemon on the same socket is refused, and the first one still answers.
    let sock = d.socket.display().to_string();
    common::fails_with(
        &[
            "host",
            "--dram",
            "256MiB",
            "--metrics",
            "off",
            "--socket",
            &sock,
        ],
        "another memtide host daemon is listening",
    );
    // A tenant that would report too rarely for the daemon is refused before it starts.
    common::fails_with(
        &[
            "run",
            &format!("--host={sock}"),
            "--stats-interval",
            "20s",
            "--",
            "true",
        ],
        "sends no report for 30s; give at most 15s",
    );
    // A minimum the budget cannot guarantee is refused before the program starts.
    common::fails_with(
        &[
            "run",
            &format!("--host={sock}"),
            "--dram",
            "1GiB",
            "--",
            "true",
        ],
        "cannot guarantee",
    );
    assert_eq!(status(&d.socket)["budget_bytes"], 256 * MIB);
}

#[test]
fn a_single_run_serves_its_own_metrics() {
    let dir = Scratch::new("run-metrics");
    let port = common::free_port();
    let child = memtide()
        .args(["run", "--dram", "64MiB", "--tier"])
        .arg(dir.path())
        .args([
            "--metrics",
            &format!("127.0.0.1:{port}"),
            "-q",
            "--name",
            "alone",
            "--",
        ])
        .arg(env!("CARGO_BIN_EXE_memtide"))
        .args(["workload", "--footprint", "128MiB", "--seconds", "8"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_port(port, Duration::from_secs(10));
    let t0 = Instant::now();
    let text = loop {
        let body = http_get(port, "/metrics").unwrap_or_default();
        // Faults from below DRAM: the compressed pool's and the file's.
        let tier_faults: u64 = body
            .lines()
            .filter(|l| {
                l.starts_with("memtide_tenant_faults_total{")
                    && (l.contains("kind=\"tier\"") || l.contains("kind=\"compressed\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum();
        if tier_faults > 0 {
            break body;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(8),
            "no tier faults in the metrics: {body}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        text.contains("memtide_tenant_quota_bytes{tenant=\"alone\""),
        "{text}"
    );
    assert!(
        text.contains("memtide_host_dram_budget_bytes 67108864"),
        "{text}"
    );
    finished_clean(child, "metrics run");
}

/// Runs `memtide top` in a tmux session and returns what the screen shows once `want` is on it.
fn tmux_screen(session: &str, want: &str) -> String {
    let t0 = Instant::now();
    loop {
        let o = Command::new("tmux")
            .args(["capture-pane", "-p", "-t", session])
            .output()
            .unwrap();
        let screen = String::from_utf8_lossy(&o.stdout).into_owned();
        if screen.contains(want) {
            return screen;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{want:?} never showed in memtide top:\n{screen}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn top_and_dashboard_show_every_tenant_and_a_red_one_red() {
    require("tmux");
    require("chromium");
    let dir = Scratch::new("host-views");
    let d = start_daemon(dir.path(), "512MiB", &[]);
    let sock = d.socket.display().to_string();
    let calm = workload_tenant(
        &d.socket,
        "calm",
        "128MiB",
        &[
            "--footprint",
            "256MiB",
            "--hot",
            "5%",
            "--hot-share",
            "100%",
            "--rate",
            "20000",
            "--seconds",
            "25",
        ],
    );
    // Its hot set (26% of 256 MiB) is 104% of the quota it is held to: red, with room for the
    // sampled estimate to wander without crossing back under the red line (75%).
    let hot = memtide()
        .args([
            "run",
            &format!("--host={sock}"),
            "--name",
            "hot",
            "--dram",
            "64MiB",
        ])
        .args(["--max", "64MiB", "-q", "--"])
        .arg(env!("CARGO_BIN_EXE_memtide"))
        .args([
            "workload",
            "--footprint",
            "256MiB",
            "--hot",
            "26%",
            "--hot-share",
            "100%",
        ])
        .args(["--seconds", "25"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Red for its active memory (not a passing latency spike while it fills), three samples
    // in a row: the steady state the dashboard must show.
    let t0 = Instant::now();
    let mut in_a_row = 0;
    loop {
        let s = status(&d.socket);
        let red = tenant(&s, "hot").is_some_and(|t| {
            t["health"] == "red" && t["active_pct"].as_f64().unwrap_or(0.0) > 75.0
        });
        in_a_row = if red { in_a_row + 1 } else { 0 };
        if in_a_row >= 3 && tenant(&s, "calm").is_some() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the tenant held below its hot set never turned red: {s}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    // The terminal view: both tenants, sortable, and q quits.
    let session = format!("memtide-top-{}", std::process::id());
    let ok = Command::new("tmux")
        .args(["new-session", "-d", "-s", &session, "-x", "160", "-y", "30"])
        .arg(format!(
            "{} top --socket {sock} --interval 300ms",
            env!("CARGO_BIN_EXE_memtide")
        ))
        .status()
        .unwrap();
    assert!(ok.success());
    let screen = tmux_screen(&session, "calm");
    assert!(screen.contains("hot"), "{screen}");
    assert!(screen.contains("sorted by quota"), "{screen}");
    Command::new("tmux")
        .args(["send-keys", "-t", &session, "s"])
        .status()
        .unwrap();
    tmux_screen(&session, "sorted by DRAM");
    Command::new("tmux")
        .args(["send-keys", "-t", &session, "q"])
        .status()
        .unwrap();
    let t1 = Instant::now();
    while Command::new("tmux")
        .args(["has-session", "-t", &session])
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
    {
        assert!(
            t1.elapsed() < Duration::from_secs(5),
            "q did not quit memtide top"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // The dashboard in a real browser: charts with data for each tenant, the red one red.
    let url = format!("http://127.0.0.1:{}/", d.metrics);
    let browser = |args: &[&str]| {
        Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
            ])
            .args(["--virtual-time-budget=5000", "--window-size=1280,1000"])
            .args(args)
            .arg(&url)
            .output()
            .unwrap()
    };
    // The page colours each card by the tenant's last sample in the daemon's history. The hot
    // tenant's estimated active memory is sampled and may dip below the red line now and then,
    // so the page is read while every sample from just before the load to just after it says
    // red: the one the page drew is among them, and it must show red.
    let hot_samples = || -> Vec<(f64, String)> {
        let body = http_get(d.metrics, "/api/history").unwrap_or_default();
        let points: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        points
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| {
                let t = p["tenants"]
                    .as_array()?
                    .iter()
                    .find(|t| t["name"] == "hot")?;
                Some((p["t"].as_f64()?, t["health"].as_str()?.to_string()))
            })
            .collect()
    };
    let mut dom = String::new();
    for attempt in 0.. {
        assert!(
            attempt < 40,
            "the hot tenant's samples did not stay red across a page load: {:?}",
            hot_samples()
        );
        let Some((since, health)) = hot_samples().last().cloned() else {
            std::thread::sleep(Duration::from_millis(250));
            continue;
        };
        if health != "red" {
            std::thread::sleep(Duration::from_millis(250));
            continue;
        }
        dom = String::from_utf8_lossy(&browser(&["--dump-dom"]).stdout).into_owned();
        if hot_samples()
            .iter()
            .filter(|(t, _)| *t >= since)
            .all(|(_, h)| h == "red")
        {
            break;
        }
    }
    assert!(
        dom.contains("data-ready=\"1\""),
        "the page never rendered: {dom}"
    );
    for (name, colour) in [("hot", Some("red")), ("calm", None)] {
        let at = dom
            .find(&format!("data-tenant=\"{name}\""))
            .unwrap_or_else(|| panic!("no card for {name}: {dom}"));
        let card = &dom[at..];
        let card = &card[..card[1..].find("data-tenant=").map_or(card.len(), |e| e + 1)];
        if let Some(c) = colour {
            assert!(
                card.contains(&format!("data-health=\"{c}\"")),
                "{name}: {card}"
            );
        }
        let points: Vec<usize> = card
            .match_indices("data-points=\"")
            .filter_map(|(i, m)| {
                let rest = &card[i + m.len()..];
                rest[..rest.find('"')?].parse().ok()
            })
            .collect();
        assert!(
            points.len() >= 11 && points.iter().all(|&n| n >= 2),
            "{name}'s charts have too little data: {points:?}"
        );
        // The levels below DRAM: the pool's DRAM and what it holds, the file; faults by level.
        for series in ["pool DRAM", "in the pool", "in the file", "compressed pool"] {
            assert!(
                card.contains(&format!("data-series=\"{series}\"")),
                "{name}: no {series} series"
            );
        }
    }
    let shot = dir.path().join("dashboard.png");
    let o = browser(&[&format!("--screenshot={}", shot.display())]);
    let png = std::fs::read(&shot).unwrap_or_else(|_| panic!("{}", common::stderr(&o)));
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000);
    if let Some(keep) = std::env::var_os("MEMTIDE_KEEP_SCREENSHOT") {
        std::fs::copy(&shot, keep).unwrap();
    }
    finished_clean(calm, "calm tenant");
    finished_clean(hot, "hot tenant");
}

/// What a hostile member of the socket's group does, phase by phase, as nobody: each phase
/// ends with one JSON line on stdout; the flood waits for a line on stdin before it lets go.
const HOSTILE: &str = r#"
import json, os, socket, sys, time
path, taken = sys.argv[1], int(sys.argv[2])
def connect():
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    return s, s.makefile('rwb')
def call(f, msg):
    f.write((msg if isinstance(msg, bytes) else json.dumps(msg).encode()) + b'\n')
    f.flush()
    return json.loads(f.readline())
def say(**kw):
    print(json.dumps(kw), flush=True)
s0, f0 = connect()
wrap = 2**64 - taken + 65536
a = {}
a['wrap_register'] = call(f0, {"register": {"name": "x", "pid": os.getpid(), "min_bytes": wrap}})
name = "evil\x1b[2J\x1b]0;owned\x07\nmemtide host: tenant 1 (roots) left"
a['register'] = call(f0, {"register": {"name": name, "pid": 1, "min_bytes": 64 << 20}})
a['wrap_set'] = call(f0, {"set": {"min_bytes": wrap}})
figures = dict(dram_bytes=2**63, tier_bytes=2**63, tier_limit_bytes=2**64 - 1,
    managed_bytes=2**64 - 1, active_bytes=2**64 - 1, faults_zero=2**64 - 1,
    faults_tier=2**64 - 1, faults_inactive=2**64 - 1, faults_wait=0, promotions=0,
    demotions=0, tier_read_bytes=0, tier_write_bytes=0, tier_read_latency_buckets=[],
    tier_read_latency_sum_us=0.0, tier_reads=0, tier_read_latency_p50_us=0.0,
    tier_read_latency_p99_us=0.0)
a['inflated'] = call(f0, {"report": figures})
a['buckets'] = call(f0, {"report": dict(figures, tier_reads=100,
    tier_read_latency_buckets=[[float(i + 1), 1] for i in range(65)])})
a['huge'] = call(f0, {"report": dict(figures, tier_reads=100,
    tier_read_latency_buckets=[[float(i + 1), 1] for i in range(20000)])})
a['negative'] = call(f0, {"report": dict(figures, tier_read_latency_p99_us=-1.0)})
a['garbage'] = call(f0, b'{"report": {"dram_bytes": 1e400}}')
a['again'] = call(f0, {"report": figures})
say(phase="terms", answers=a)
flood = []
for _ in range(100):
    try:
        flood.append(connect()[0])
    except OSError:
        break
time.sleep(0.5)
refused = 0
for c in flood:
    c.setblocking(False)
    try:
        if c.recv(4096):
            refused += 1
    except BlockingIOError:
        pass
say(phase="flood", opened=len(flood), refused=refused)
sys.stdin.readline()
for c in flood:
    c.close()
s1, f1 = connect()
t0 = time.time()
f1.write(b'"status"\n' * 400)
f1.flush()
for _ in range(400):
    json.loads(f1.readline())
say(phase="requests", seconds=time.time() - t0)
s2, f2 = connect()
quiet = call(f2, {"register": {"name": "quiet", "pid": os.getpid(), "min_bytes": 64 << 20}})
t0 = time.time()
gone = None
while time.time() - t0 < 10:
    if not call(f2, "status")["status"]["tenants"]:
        gone = time.time() - t0
        break
    time.sleep(0.25)
again = call(f2, {"report": figures})
say(phase="silent", tenant=quiet["registered"]["tenant"], closed_after=gone, again=again)
"#;

/// CPU seconds a process has used (user + system).
fn cpu_seconds(pid: u32) -> f64 {
    let f = memtide_engine::sys::stat_fields(&format!("/proc/{pid}/stat")).unwrap();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0
}

fn has_control(s: &str) -> bool {
    s.chars().any(|c| c.is_control() && c != '\n')
}

#[test]
fn a_hostile_member_cannot_take_the_host() {
    require("/usr/bin/python3");
    require("setpriv");
    let dir = Scratch::new("host-hostile");
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let budget = 512 * MIB;
    // Few file descriptors: a flood that reached the daemon's limit would show at once.
    let d = start_daemon_with(
        dir.path(),
        "512MiB",
        &["--group", "nogroup", "--tenant-timeout", "3s"],
        Some(128),
    );
    let daemon_pid = d.server.0.id();
    let roots = workload_tenant(
        &d.socket,
        "roots",
        "128MiB",
        &["--footprint", "96MiB", "--seconds", "15", "--rate", "20000"],
    );
    let t0 = Instant::now();
    while tenant(&status(&d.socket), "roots").is_none() {
        assert!(t0.elapsed() < Duration::from_secs(10), "roots never joined");
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut hostile = Command::new("setpriv")
        .args([
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            HOSTILE,
        ])
        .arg(&d.socket)
        .arg((128 * MIB).to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut said = BufReader::new(hostile.stdout.take().unwrap()).lines();
    let mut next = |phase: &str| -> serde_json::Value {
        let l = said
            .next()
            .unwrap_or_else(|| panic!("the hostile client ended before {phase}"))
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&l).unwrap();
        assert_eq!(v["phase"], phase, "{v}");
        v
    };

    // Overflowing and absurd numbers, oversized and malformed reports.
    let terms = next("terms");
    let a = &terms["answers"];
    let refused = |k: &str, needle: &str| {
        let m = a[k]["error"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("{k} was not refused: {}", a[k]));
        assert!(m.contains(needle), "{k}: {needle:?} not in {m:?}");
    };
    refused("wrap_register", "cannot guarantee");
    refused("wrap_set", "cannot guarantee");
    refused("buckets", "latency buckets");
    refused("huge", "longer than");
    refused("negative", "at least 0");
    refused("garbage", "malformed");
    let id = a["register"]["registered"]["tenant"].as_u64().unwrap();
    for k in ["inflated", "again"] {
        assert!(
            a[k]["quota"]["quota_bytes"].as_u64().is_some(),
            "{k}: {}",
            a[k]
        );
    }
    let s = status(&d.socket);
    check_quotas(&s, budget);
    let evil = s["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tenant"] == id)
        .expect("the hostile tenant is listed")
        .clone();
    let name = evil["name"].as_str().unwrap();
    assert!(!has_control(name) && !name.contains('\n'), "{name:?}");
    // What it claims is bounded by what its processes hold (a python: well under 1 GiB
    // mapped, some MiB resident, no tier file), whatever it says.
    let rep = &evil["report"];
    let managed = rep["managed_bytes"].as_u64().unwrap();
    assert!(managed < 1 << 30, "managed {managed}");
    assert!(rep["active_bytes"].as_u64().unwrap() <= 64 * MIB, "{rep}");
    assert!(rep["dram_bytes"].as_u64().unwrap() <= 64 * MIB, "{rep}");
    assert_eq!(rep["tier_bytes"], 0, "it holds no tier file: {rep}");
    assert_ne!(evil["pid"], 1, "pid 1 is not the hostile client's");
    let r = tenant(&s, "roots").unwrap();
    assert!(r["quota_bytes"].as_u64().unwrap() >= 128 * MIB, "{r}");

    // A flood of connections: the member holds a bounded number, the daemon stays idle and
    // everyone else is served.
    let flood = next("flood");
    let (opened, turned) = (
        flood["opened"].as_u64().unwrap(),
        flood["refused"].as_u64().unwrap(),
    );
    assert_eq!(opened, 100, "{flood}");
    assert!(turned >= 100 - 31, "only {turned} of 100 refused");
    let cpu0 = (cpu_seconds(daemon_pid), Instant::now());
    // Meanwhile HTTP clients that ask nothing or never read their answer.
    let port = d.metrics;
    let mut slow: Vec<std::net::TcpStream> = (0..8)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    for c in slow.iter_mut().step_by(2) {
        write!(c, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
    }
    std::thread::sleep(Duration::from_secs(2));
    let t_scrape = Instant::now();
    assert!(
        http_get(port, "/metrics").is_some_and(|m| m.contains("# EOF")),
        "a scrape beside slow clients"
    );
    assert!(t_scrape.elapsed() < Duration::from_secs(2));
    let s = status(&d.socket);
    check_quotas(&s, budget);
    let o = memtide()
        .arg("run")
        .arg(format!("--host={}", d.socket.display()))
        .args(["--dram", "64MiB", "-q", "--", "true"])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "a new tenant could not join: {}",
        common::stderr(&o)
    );
    let busy = (cpu_seconds(daemon_pid) - cpu0.0) / cpu0.1.elapsed().as_secs_f64();
    assert!(busy < 0.2, "the daemon used {:.0}% of a CPU", busy * 100.0);
    hostile.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();

    // A flood of requests waits at the member's rate.
    let cpu0 = (cpu_seconds(daemon_pid), Instant::now());
    let req = next("requests");
    let took = req["seconds"].as_f64().unwrap();
    assert!(took > 2.0, "400 requests served in {took:.2} s");
    let busy = (cpu_seconds(daemon_pid) - cpu0.0) / cpu0.1.elapsed().as_secs_f64();
    assert!(busy < 0.2, "the daemon used {:.0}% of a CPU", busy * 100.0);

    // A tenant that stops reporting leaves, and its minimum goes back: the first (idle
    // through the flood), and one that only asks for the status; its next report is told.
    let silent = next("silent");
    let after = silent["closed_after"].as_f64().expect("never let go");
    assert!((2.0..8.0).contains(&after), "{silent}");
    let m = silent["again"]["error"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(m.contains("no longer registered"), "{silent}");
    let quiet = silent["tenant"].as_u64().unwrap();
    let s = status(&d.socket);
    for gone in [id, quiet] {
        assert!(
            !s["tenants"]
                .as_array()
                .unwrap()
                .iter()
                .any(|t| t["tenant"] == gone),
            "{s}"
        );
    }
    assert!(hostile.wait().unwrap().success());

    drop(slow);
    // The HTTP side: with --group it shows the host's totals only, and a request by a name
    // (as a rebinding web page makes) is refused.
    let metrics = http_get(port, "/metrics").unwrap();
    assert!(
        metrics.contains("memtide_host_dram_budget_bytes"),
        "{metrics}"
    );
    assert!(!metrics.contains("roots"), "{metrics}");
    let api = http_get(port, "/api/status").unwrap();
    assert!(!api.contains("roots"), "{api}");
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        c,
        "GET /metrics HTTP/1.1\r\nHost: rebound.example:{port}\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    c.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");

    // Nothing the daemon or `memtide status` printed carries a raw control character.
    let text = memtide()
        .args(["status", "--socket"])
        .arg(&d.socket)
        .output()
        .unwrap();
    assert!(!has_control(&String::from_utf8_lossy(&text.stdout)));
    finished_clean(roots, "root's tenant");
    let log = d.log.lock().unwrap();
    for said in ["owned", "stopped reporting"] {
        assert!(
            log.iter().any(|l| l.contains(said)),
            "{said:?} never logged"
        );
    }
    // Refusals are logged, but not one line per connection.
    let refusals = log
        .iter()
        .filter(|l| l.contains("refused a connection"))
        .count();
    assert!((1..=3).contains(&refusals), "{refusals} refusals logged");
    for l in log.iter() {
        assert!(!has_control(l), "raw control characters logged: {l:?}");
    }
}
