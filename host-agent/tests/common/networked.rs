//! Sessions with a network, for the tests that run them: a host-agent
//! whose `network` uses a namespace standing for the node, the virtio-net
//! test guest's image and golden snapshot, and looks into the namespaces.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use proto::hostagent as pb;

use super::netns::{missing_tools, Ns};
use super::*;

/// The jailed vmm under jailer `pid`.
pub fn jailed_vmm(pid: u32) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let children =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        if let Some(c) = children.split_whitespace().next() {
            return c.parse().unwrap();
        }
        assert!(Instant::now() < deadline, "no jailed vmm under {pid}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The session's namespaces under `prefix`.
pub fn namespaces(prefix: &str) -> Vec<String> {
    host_agent::network::namespace::list_namespaces(prefix)
}

pub fn wait_gone(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} is still there",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A namespace standing for the node, and a host-agent whose `network`
/// uses it with `pool` (a block, or a list of an IPv4 and an IPv6 block),
/// `allow` and the namespace prefix `prefix`; `extra` are more host-agent
/// flags.
pub fn networked_agent(
    name: &str,
    prefix: &str,
    pool: impl Into<serde_json::Value>,
    allow: &[&str],
    extra: &[&str],
) -> (Ns, tempfile::TempDir, Agent) {
    let node = Ns::new(name.to_string());
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.json");
    std::fs::write(
        &cfg,
        serde_json::json!({
            "network": {
                "pool": pool.into(),
                "node_netns": node.0,
                "netns_prefix": prefix,
                "allow": allow,
                // Never asked here: the tests' names are denied ones. Set,
                // so the tests do not depend on this machine's resolv.conf.
                "dns_upstreams": ["127.0.0.1:9"],
            }
        })
        .to_string(),
    )
    .unwrap();
    let mut args = vec!["--config", cfg.to_str().unwrap()];
    args.extend_from_slice(extra);
    let agent = Agent::start(&args);
    (node, dir, agent)
}

/// The elements of set `name` in the VM namespace `netns`, as nft lists them.
pub fn nft_set(netns: &str, name: &str) -> String {
    let out = Command::new("ip")
        .args([
            "netns", "exec", netns, "nft", "list", "set", "ip", "agentvm", name,
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The image of the virtio-net test guest (it sends a frame, then waits).
pub fn net_image() -> pb::RegisterImageRequest {
    pb::RegisterImageRequest {
        image_id: "net".into(),
        kernel_path: test_harness::guests::path("virtio_net")
            .display()
            .to_string(),
        // Waits for its frame (none comes) far longer than any test runs,
        // and never resets: past 8 other frames (a node with IPv6 sends
        // neighbour discovery and MLD to the tap; 8 can come within a test
        // on a loaded machine) it would end, and the session with it, so
        // `hold=1` keeps it spinning.
        cmdline: "console=ttyS0 rx_spins=1000000000000000 hold=1".into(),
        mem_mib: 32,
        vcpus: 1,
        ..Default::default()
    }
}

/// Its golden snapshot.
pub fn net_golden() -> pb::BuildGoldenSnapshotRequest {
    pb::BuildGoldenSnapshotRequest {
        image_id: "net".into(),
        settle_ms: 300,
        ..Default::default()
    }
}

/// Whether the network session tests can run here (printing why not).
pub fn can_run() -> bool {
    if !jail_supported() {
        return false;
    }
    if let Some(why) = missing_tools() {
        println!("skipped: {why}");
        return false;
    }
    true
}

/// A warm VM of the pool as its directory shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmDir {
    /// The pid in its `pid` file (the session that takes it has this pid).
    pub pid: u32,
    /// The namespace it records (`network-namespace`), if any.
    pub netns: Option<String>,
}

/// The warm VMs in `agent`'s pool directory that are restored (their `pid`
/// file is written once the vmm runs).
pub fn warm_dirs(agent: &Agent) -> Vec<WarmDir> {
    std::fs::read_dir(agent.state_dir().join("pool"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let pid = std::fs::read_to_string(e.path().join("pid")).ok()?;
                    let pid = pid.split_whitespace().next()?.parse().ok()?;
                    let netns = std::fs::read_to_string(e.path().join("network-namespace"))
                        .ok()
                        .map(|n| n.trim().to_string());
                    Some(WarmDir { pid, netns })
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Waits (up to 120 s) until `agent` reports at least `n` warm VMs ready.
pub async fn wait_warm(agent: &Agent, n: u32) {
    let mut node = agent.node().await;
    let deadline = Instant::now() + Duration::from_secs(120);
    while node
        .get_capacity(pb::GetCapacityRequest {})
        .await
        .unwrap()
        .into_inner()
        .warm_pool_ready
        < n
    {
        assert!(
            Instant::now() < deadline,
            "the pool never reached {n} warm VMs"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The nftables tables in namespace `netns`, one `family name` a line.
pub fn nft_tables(netns: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "exec", netns, "nft", "list", "tables"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("table "))
        .map(str::to_string)
        .collect()
}

/// The inode of the network namespace process `pid` is in.
pub fn netns_of(pid: u32) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/net"))
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

/// The inode of the named namespace, as `/proc/PID/ns/net` reads.
pub fn netns_inode(name: &str) -> String {
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(Path::new("/run/netns").join(name))
        .unwrap()
        .ino();
    format!("net:[{ino}]")
}

/// Waits (up to 20 s) until the namespaces under `prefix` are `want`
/// (in any order).
pub fn wait_namespaces(prefix: &str, want: &[String]) {
    let mut want = want.to_vec();
    want.sort();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut now = namespaces(prefix);
        now.sort();
        if now == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "namespaces {now:?}, expected {want:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Registers the virtio-net test guest's image (`net`) with `agent` and
/// builds its golden snapshot.
pub async fn build_net_image(agent: &Agent) {
    let mut images = agent.images().await;
    images.register_image(net_image()).await.expect("register");
    images
        .build_golden_snapshot(net_golden())
        .await
        .expect("golden snapshot");
}

/// Waits until no namespace under `prefix` is left (20 s at most).
pub fn wait_no_namespaces(prefix: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !namespaces(prefix).is_empty() {
        assert!(Instant::now() < deadline, "left: {:?}", namespaces(prefix));
        std::thread::sleep(Duration::from_millis(20));
    }
}
