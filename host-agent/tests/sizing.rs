//! A session's size (`CreateSessionRequest.resources`): within the image's,
//! checked field by field; a larger root disk is restored grown; a CPU cap
//! is the jail's cgroup quota; the node commits each session's memory and
//! refuses past `memory_overcommit_ratio`. (What guest-init does with a
//! size is in guest-init's tests and the real-guest node-sizing scenario.)

mod common;

use common::*;
use proto::hostagent as pb;
use tonic::Code;

fn sized(image: &str, key: &str, r: pb::SessionResources) -> pb::CreateSessionRequest {
    pb::CreateSessionRequest {
        image_id: image.into(),
        idempotency_key: key.into(),
        resources: Some(r),
        ..Default::default()
    }
}

/// The node's capacity as GetCapacity reports it.
async fn capacity(agent: &Agent) -> pb::Capacity {
    agent
        .node()
        .await
        .get_capacity(pb::GetCapacityRequest {})
        .await
        .expect("GetCapacity")
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_larger_disk_is_restored_grown_and_bad_sizes_name_their_field() {
    let t = tempfile::tempdir().unwrap();
    let source = rootfs(t.path());
    let agent = Agent::start(&["--no-jail"]);
    disk_image(&agent, &source).await;
    agent.counter_image("counter").await;
    let mut c = agent.sessions().await;

    let s = c
        .create_session(sized(
            "disk",
            "grown",
            pb::SessionResources {
                disk_mib: 16,
                ..Default::default()
            },
        ))
        .await
        .expect("a session with a larger disk")
        .into_inner();
    assert_eq!(s.state, S::Running as i32);
    assert_eq!(
        s.resources,
        Some(pb::SessionResources {
            vcpus: 1,
            mem_mib: 32,
            cpu_millis: 0,
            disk_mib: 16,
        }),
        "every field filled, the image's where not asked"
    );
    let disk = agent
        .state_dir()
        .join("sessions")
        .join(&s.session_id)
        .join("disk.ext4");
    let data = std::fs::read(&disk).unwrap();
    assert_eq!(data.len(), 16 << 20, "grown to the size asked");
    assert_eq!(&data[..12], b"image rootfs", "the image's data kept");
    assert_eq!(&data[(4 << 20) - 4..4 << 20], b"tail");
    // The vmm restored the grown disk and runs on.
    let again = agent.get(&s.session_id).await;
    assert_eq!(again.state, S::Running as i32, "{again:?}");
    assert_eq!(again.resources, s.resources);

    for (image, r, code, field) in [
        (
            "disk",
            (2, 0, 0, 0),
            Code::InvalidArgument,
            "resources.vcpus",
        ),
        (
            "disk",
            (0, 64, 0, 0),
            Code::InvalidArgument,
            "resources.mem_mib",
        ),
        // A smaller memory needs guest-init to confine it.
        (
            "disk",
            (0, 16, 0, 0),
            Code::InvalidArgument,
            "resources.mem_mib",
        ),
        (
            "disk",
            (0, 0, 0, 2),
            Code::InvalidArgument,
            "resources.disk_mib",
        ),
        (
            "disk",
            (0, 0, 5, 0),
            Code::InvalidArgument,
            "resources.cpu_millis",
        ),
        (
            "counter",
            (0, 0, 0, 8),
            Code::InvalidArgument,
            "resources.disk_mib",
        ),
        // A CPU cap needs the jail, and this node runs unjailed.
        (
            "disk",
            (0, 0, 500, 0),
            Code::FailedPrecondition,
            "resources.cpu_millis",
        ),
    ] {
        let (vcpus, mem_mib, cpu_millis, disk_mib) = r;
        let req = sized(
            image,
            "",
            pb::SessionResources {
                vcpus,
                mem_mib,
                cpu_millis,
                disk_mib,
            },
        );
        let e = c.create_session(req).await.expect_err("refused");
        assert_eq!(e.code(), code, "{r:?}: {e}");
        assert!(e.message().contains(field), "{r:?}: {}", e.message());
    }

    // Committed: the one live session's memory.
    let cap = capacity(&agent).await;
    assert_eq!(cap.memory_mib_used, 32, "{cap:?}");
    assert_eq!(cap.memory_overcommit_ratio, 1.0);
    assert_eq!(cap.memory_mib_limit, cap.memory_mib_total, "{cap:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_past_the_overcommit_ratio_is_refused_until_a_session_ends() {
    let agent = Agent::start(&["--no-jail", "--memory-overcommit-ratio", "0.1"]);
    let cap = capacity(&agent).await;
    assert_eq!(cap.memory_overcommit_ratio, 0.1);
    let limit = cap.memory_mib_limit;
    assert_eq!(limit, (cap.memory_mib_total as f64 * 0.1) as u64, "{cap:?}");
    // An image of which one session fits and two do not.
    let mem_mib = u32::try_from(limit / 2 + 1).unwrap().clamp(32, 65536);
    assert!(u64::from(mem_mib) * 2 > limit && u64::from(mem_mib) <= limit);
    let mut im = agent.images().await;
    im.register_image(pb::RegisterImageRequest {
        image_id: "big".into(),
        kernel_path: counter_kernel(),
        cmdline: "interval=100000000".into(),
        mem_mib,
        vcpus: 1,
        ..Default::default()
    })
    .await
    .expect("register");
    im.build_golden_snapshot(pb::BuildGoldenSnapshotRequest {
        image_id: "big".into(),
        settle_ms: 50,
        ..Default::default()
    })
    .await
    .expect("golden snapshot");

    let first = agent.create("big", "first").await;
    assert_eq!(first.state, S::Running as i32);
    let e = agent
        .sessions()
        .await
        .create_session(pb::CreateSessionRequest {
            image_id: "big".into(),
            ..Default::default()
        })
        .await
        .expect_err("past the ratio");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert!(
        e.message().contains("memory_overcommit_ratio 0.1"),
        "{}",
        e.message()
    );
    let cap = capacity(&agent).await;
    assert_eq!(cap.memory_mib_used, u64::from(mem_mib));

    agent.stop(&first.session_id).await;
    let second = agent.create("big", "second").await;
    assert_eq!(second.state, S::Running as i32, "room again once one ended");
}

/// The cgroup quota of a jailed vmm, as `(quota_us, period_us)`: cgroup v2's
/// cpu.max or v1's cfs files, whichever hierarchy holds its cpu controller.
fn cpu_quota_of(pid: u32) -> (u64, u64) {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    for line in cgroups.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next(), f.next().unwrap(), f.next().unwrap());
        let rel = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "cpu") {
            let dir = std::path::Path::new("/sys/fs/cgroup/cpu").join(rel);
            let read = |f: &str| -> u64 {
                std::fs::read_to_string(dir.join(f))
                    .unwrap()
                    .trim()
                    .parse()
                    .unwrap()
            };
            return (read("cpu.cfs_quota_us"), read("cpu.cfs_period_us"));
        }
        if controllers.is_empty() && path.contains("/agentvm/") {
            let max = std::fs::read_to_string(
                std::path::Path::new("/sys/fs/cgroup")
                    .join(rel)
                    .join("cpu.max"),
            )
            .unwrap();
            let mut v = max.split_whitespace().map(|x| x.parse::<u64>().unwrap());
            return (v.next().unwrap(), v.next().unwrap());
        }
    }
    panic!("no cpu cgroup in {cgroups}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cpu_cap_is_the_jails_cgroup_quota() {
    if !jail_supported() {
        return;
    }
    let agent = Agent::start(&[]);
    agent.counter_image("counter").await;
    let s = agent
        .sessions()
        .await
        .create_session(sized(
            "counter",
            "capped",
            pb::SessionResources {
                cpu_millis: 250,
                ..Default::default()
            },
        ))
        .await
        .expect("a capped session")
        .into_inner();
    assert_eq!(s.state, S::Running as i32);
    assert_eq!(s.resources.as_ref().map(|r| r.cpu_millis), Some(250));
    let vmm = networked::jailed_vmm(s.vmm_pid);
    assert_eq!(cpu_quota_of(vmm), (25_000, 100_000));
}
