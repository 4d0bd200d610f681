//! Device rate limits through the API: an image's limits reach its VMs'
//! vmm command line, and a session's overrides replace them field by
//! field. Needs root, cgroups, iproute2 and nftables (the limits are on
//! the network device of a networked session); says so and skips without
//! them.

mod common;

use common::netns::PrefixCleanup;
use common::networked::{can_run, jailed_vmm, net_golden, net_image, networked_agent};
use common::*;
use proto::hostagent as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_images_rate_limits_reach_its_vms_and_a_session_may_override_them() {
    if !can_run() {
        return;
    }
    let tag = std::process::id();
    let prefix = format!("avl{tag}-");
    let _cleanup = PrefixCleanup(prefix.clone());
    let (_node, _cfg, mut agent) =
        networked_agent(&format!("sl{tag}"), &prefix, "10.209.0.0/29", &[], &[]);
    let mut images = agent.images().await;
    let limits = pb::IoLimits {
        net_tx_bandwidth: "1M".into(),
        net_rx_packets: "1000/100".into(),
        ..Default::default()
    };
    let bad = images
        .register_image(pb::RegisterImageRequest {
            io_limits: Some(pb::IoLimits {
                disk_iops: "fast".into(),
                ..Default::default()
            }),
            ..net_image()
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("disk_iops"), "{}", bad.message());
    let img = images
        .register_image(pb::RegisterImageRequest {
            io_limits: Some(limits),
            ..net_image()
        })
        .await
        .expect("register")
        .into_inner();
    // Stored as the vmm reads them back: sizes in plain numbers.
    let got = img.io_limits.expect("limits");
    assert_eq!(got.net_tx_bandwidth, "1048576");
    assert_eq!(got.net_rx_packets, "1000/100");
    images
        .build_golden_snapshot(net_golden())
        .await
        .expect("golden snapshot");
    let vmm_args = |pid: u32| {
        let raw = std::fs::read(format!("/proc/{}/cmdline", jailed_vmm(pid))).unwrap();
        String::from_utf8_lossy(&raw).replace('\0', " ")
    };

    // The image's limits, on the session's NIC.
    let s = agent.create("net", "").await;
    let s = agent.wait_state(&s.session_id, S::Running).await;
    let args = vmm_args(s.vmm_pid);
    assert!(
        args.contains("tx_bw=1048576") && args.contains("rx_ops=1000/100"),
        "{args}"
    );
    assert_eq!(s.io_limits.unwrap().net_tx_bandwidth, "1048576");
    agent.stop(&s.session_id).await;

    // A session's own, field by field; the rest stays the image's.
    let mut sessions = agent.sessions().await;
    let s = sessions
        .create_session(pb::CreateSessionRequest {
            image_id: "net".into(),
            io_limits: Some(pb::IoLimits {
                net_tx_bandwidth: "64K".into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("create")
        .into_inner();
    let s = agent.wait_state(&s.session_id, S::Running).await;
    let args = vmm_args(s.vmm_pid);
    assert!(
        args.contains("tx_bw=65536") && args.contains("rx_ops=1000/100"),
        "{args}"
    );
    let l = agent.get(&s.session_id).await.io_limits.expect("limits");
    assert_eq!(
        (l.net_tx_bandwidth.as_str(), l.net_rx_packets.as_str()),
        ("65536", "1000/100")
    );
    agent.stop(&s.session_id).await;
    agent.terminate();
}
