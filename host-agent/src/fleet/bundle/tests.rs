//! The bundle format's tests: what a session bundle carries, its checks
//! as untrusted input, and the destination node's name.

use super::*;

fn chained(jsons: &[&str]) -> Vec<BundleAudit> {
    let mut prev = String::new();
    jsons
        .iter()
        .enumerate()
        .map(|(i, j)| {
            let mut h = Sha256::new();
            h.update(prev.as_bytes());
            h.update(j.as_bytes());
            prev = hex::encode(h.finalize());
            BundleAudit {
                guest_seq: i as u64 + 1,
                json: j.to_string(),
                host_hash: prev.clone(),
                received_at: 1,
            }
        })
        .collect()
}

fn layer(id: &str, kind: &str, parent: &str) -> BundleLayer {
    BundleLayer {
        id: id.into(),
        kind: kind.into(),
        parent: parent.into(),
        owner_session: "s".into(),
        created_at: 1,
    }
}

fn bundle() -> SessionBundle {
    let row = SessionRow {
        id: "s".into(),
        image_id: "img".into(),
        execution_id: "e".into(),
        owner: "o".into(),
        ..Default::default()
    };
    SessionBundle {
        format: FORMAT,
        session: BundleSession::from_row(&row),
        layers: vec![
            layer("g-1", kind::GOLDEN, ""),
            layer("p1", kind::PAUSE, "g-1"),
            layer("p2", kind::PAUSE, "p1"),
        ],
        golden_layer: "g-1".into(),
        from_node: "node-a".into(),
        to_node: "node-b".into(),
        jailed: true,
        disk: false,
        audit: chained(&["{\"a\":1}", "{\"b\":2}"]),
        last_usage: None,
        moved_at: 1,
    }
}

#[test]
fn a_good_bundle_passes_and_round_trips_through_json() {
    let b = bundle();
    b.check("s").unwrap();
    let back: SessionBundle = serde_json::from_value(serde_json::to_value(&b).unwrap()).unwrap();
    assert_eq!(back, b);
    let moved: Vec<&str> = b.moved_layers().iter().map(|l| l.id.as_str()).collect();
    assert_eq!(moved, ["p1", "p2"]);
}

#[test]
fn a_bundle_that_does_not_hold_together_is_data_loss() {
    type Change = Box<dyn Fn(&mut SessionBundle)>;
    let cases: Vec<(&str, Change)> = vec![
        ("describes session", Box::new(|b| b.session.id = "t".into())),
        ("format", Box::new(|b| b.format = 2)),
        (
            "names parent",
            Box::new(|b| b.layers[2].parent = "g-1".into()),
        ),
        (
            "snapshot layer id",
            Box::new(|b| b.layers[1].id = "../etc".into()),
        ),
        ("no layer above", Box::new(|b| b.layers.truncate(1))),
        (
            "does not chain",
            Box::new(|b| b.audit[1].json = "{}".into()),
        ),
        (
            "guest seq",
            Box::new(|b| {
                b.audit.remove(0);
            }),
        ),
        (
            "names golden layer",
            Box::new(|b| b.golden_layer = "g-2".into()),
        ),
        ("node name", Box::new(|b| b.to_node = "a b".into())),
    ];
    for (want, change) in cases {
        let mut b = bundle();
        change(&mut b);
        let e = b.check("s").unwrap_err();
        assert_eq!(e.code(), tonic::Code::DataLoss, "{want}: {e}");
        assert!(e.to_string().contains(want), "{want}: {e}");
    }
}

#[test]
fn to_node_is_a_node_name_and_not_this_one() {
    check_to_node("node-b", "node-a").unwrap();
    for bad in ["", "a b", "a.b", &"n".repeat(65), "node-a"] {
        let e = check_to_node(bad, "node-a").unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad:?}");
    }
}

#[test]
fn usage_counters_round_trip() {
    let u = UsageRow {
        session_id: "x".into(),
        execution_id: "e".into(),
        interval_start: 1,
        interval_end: 2,
        billed_ms: 3000,
        vcpu_ns: 4,
        mem_alloc_gib_ms: 5.5,
        snapshot_gib_ms: 6.5,
        disk_bytes: 7,
        raw_cpu_ns: 99,
        net: NetIo {
            rx_bytes: 8,
            dns_denied: 9,
            ..Default::default()
        },
        ..Default::default()
    };
    let back = BundleUsage::from_row(&u).to_row("s");
    assert_eq!(
        back,
        UsageRow {
            session_id: "s".into(),
            raw_cpu_ns: 0,
            ..u
        }
    );
}
