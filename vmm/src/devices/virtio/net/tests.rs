use vm_memory::{Bytes, GuestAddress};

use super::persist::{NetConstructorArgs, NetState};
use super::*;
use crate::devices::virtio::test_utils::{
    activate, add_chain, interrupt, memory, mock_queue, used, used_idx,
};
use crate::persist::Persist;

/// Why a tap cannot be made on this host, where `e` says exactly that: no
/// /dev/net/tun (ENOENT or ENODEV opening it), or EPERM / EACCES opening it
/// or attaching (TUNSETIFF) while this process lacks `CAP_NET_ADMIN`
/// (`net_admin` false). `None` for every other error, a test failure: an
/// invalid name, EINVAL, EBUSY, EPERM with the capability, a later step
/// (the virtio-net header size, eventfds, timers), or an error that is not
/// an OS error (whatever its `ErrorKind`).
fn tap_unavailable(e: &NetError, net_admin: bool) -> Option<String> {
    let NetError::Tap(tap) = e else {
        return None;
    };
    let (step, source) = match tap {
        TapError::OpenTun(source) => ("opening /dev/net/tun".to_string(), source),
        TapError::SetIff { name, source } => (format!("TUNSETIFF {name}"), source),
        TapError::Configure { .. } | TapError::VnetHdr { .. } => return None,
    };
    let opening = matches!(tap, TapError::OpenTun(_));
    match source.raw_os_error()? {
        libc::ENOENT | libc::ENODEV if opening => {
            Some(format!("no tun device on this host ({step}: {source})"))
        }
        libc::EPERM | libc::EACCES if !net_admin => Some(format!(
            "no CAP_NET_ADMIN to create a tap ({step}: {source})"
        )),
        _ => None,
    }
}

/// A tap device for the test, or `None` (with `skipped: <why>` printed) where
/// this host cannot make one (see [`tap_unavailable`]); any other error fails
/// the test.
fn net(name: &str, mac: Option<[u8; 6]>) -> Option<Net> {
    let name = format!("{name}{}", std::process::id() % 10_000);
    match Net::new(&name, mac) {
        Ok(n) => Some(n),
        Err(e) => match tap_unavailable(
            &e,
            test_harness::host::has_capability(test_harness::host::CAP_NET_ADMIN),
        ) {
            Some(why) => {
                println!("skipped: cannot create tap {name}: {why}");
                None
            }
            None => panic!("cannot create tap {name}: {e}"),
        },
    }
}

#[test]
fn only_a_missing_tun_device_or_capability_skips() {
    use std::io::{Error, ErrorKind};
    let os = Error::from_raw_os_error;
    let open = |errno| NetError::Tap(TapError::OpenTun(os(errno)));
    let attach = |errno| {
        NetError::Tap(TapError::SetIff {
            name: "vnx1".into(),
            source: os(errno),
        })
    };
    // The host lacks the device or the capability: a skip, errno printed.
    for (e, net_admin) in [
        (open(libc::ENOENT), true),
        (open(libc::ENODEV), false),
        (open(libc::EACCES), false),
        (attach(libc::EPERM), false),
        (attach(libc::EACCES), false),
    ] {
        let why = tap_unavailable(&e, net_admin).unwrap_or_else(|| panic!("{e} is a skip"));
        assert!(why.contains("(os error "), "{why}");
    }
    assert!(tap_unavailable(&attach(libc::EPERM), false)
        .unwrap()
        .contains("CAP_NET_ADMIN"));
    // Anything else is a failure.
    for (e, net_admin) in [
        (attach(libc::EPERM), true),
        (open(libc::EPERM), true),
        (attach(libc::EINVAL), false),
        (attach(libc::EBUSY), false),
        (attach(libc::ENOENT), false),
        (open(libc::EMFILE), false),
        (
            NetError::Tap(TapError::VnetHdr {
                name: "vnx1".into(),
                source: os(libc::EPERM),
            }),
            false,
        ),
        (
            NetError::Tap(TapError::SetIff {
                name: "vnx1".into(),
                source: Error::new(ErrorKind::PermissionDenied, "refused by the product"),
            }),
            false,
        ),
        (NetError::Eventfd(os(libc::ENODEV)), false),
        (NetError::Timer(os(libc::EPERM)), false),
    ] {
        assert_eq!(
            tap_unavailable(&e, net_admin),
            None,
            "{e} must fail the test"
        );
    }
}

#[test]
fn mac_is_offered_only_when_configured() {
    let Some(n) = net("vnm", Some([2, 1, 2, 3, 4, 5])) else {
        return;
    };
    assert!(n.common.avail_features & (1 << VIRTIO_NET_F_MAC) != 0);
    let mut mac = [0u8; 6];
    n.read_config(0, &mut mac);
    assert_eq!(mac, [2, 1, 2, 3, 4, 5]);
    drop(n);
    let Some(n) = net("vnn", None) else {
        return;
    };
    assert_eq!(n.common.avail_features & (1 << VIRTIO_NET_F_MAC), 0);
}

#[test]
fn malformed_tx_frames_are_dropped_and_rx_without_frames_is_idle() {
    let Some(mut n) = net("vnt", None) else {
        return;
    };
    let mem = memory(4);
    let rx = mock_queue(&mem, GuestAddress(0));
    let tx = mock_queue(&mem, GuestAddress(0x1_0000));
    activate(&mut n, &mem, &[&rx, &tx]);
    // Shorter than a virtio-net header, larger than any frame, outside memory.
    add_chain(&tx, 0, &[(0x10_0000, 4, false)]);
    add_chain(&tx, 1, &[(0x10_0000, MAX_FRAME as u32 + 1, false)]);
    add_chain(&tx, 2, &[(0x100_0000_0000, 64, false)]);
    add_chain(&tx, 3, &[(0x10_0000, u32::MAX, false)]);
    assert_eq!(n.process_tx(), 4);
    assert_eq!(used_idx(&tx), 4);
    assert_eq!(n.stats().tx_dropped, 4);
    assert_eq!(n.stats().tx_frames, 0);
    assert_eq!(used(&tx, 0).1, 0);
    // The tap is down, so nothing arrives: rx buffers stay with the device.
    add_chain(&rx, 0, &[(0x20_0000, 2048, true)]);
    assert_eq!(n.process_rx(), 0);
    assert_eq!(used_idx(&rx), 0);
}

/// A device on a tap stand-in that needs no privilege, and the network side.
fn net_on_socketpair() -> (Net, std::os::unix::net::UnixDatagram) {
    let (tap, network) = Tap::pair("pair").unwrap();
    (
        Net::with_tap(tap, Some([2, 0, 0, 0, 0, 1])).unwrap(),
        network,
    )
}

#[test]
fn frames_cross_between_guest_buffers_and_the_tap_side() {
    let (mut n, host) = net_on_socketpair();
    let mem = memory(4);
    let rx = mock_queue(&mem, GuestAddress(0));
    let tx = mock_queue(&mem, GuestAddress(0x1_0000));
    activate(&mut n, &mem, &[&rx, &tx]);

    // Guest -> host: header and frame split over two descriptors arrive as one frame.
    let frame: Vec<u8> = (0..60u8).collect();
    mem.write_slice(&[0u8; VNET_HDR_LEN], GuestAddress(0x10_0000))
        .unwrap();
    mem.write_slice(&frame, GuestAddress(0x11_0000)).unwrap();
    add_chain(
        &tx,
        0,
        &[
            (0x10_0000, VNET_HDR_LEN as u32, false),
            (0x11_0000, frame.len() as u32, false),
        ],
    );
    assert_eq!(n.process_tx(), 1);
    let mut got = [0u8; 2048];
    let len = host.recv(&mut got).unwrap();
    assert_eq!(&got[VNET_HDR_LEN..len], &frame[..]);
    assert_eq!(n.stats().tx_frames, 1);

    // Host -> guest: a frame fills one guest buffer, the used length counts the header.
    let mut incoming = vec![0u8; VNET_HDR_LEN];
    incoming.extend_from_slice(b"a frame from the host side");
    host.send(&incoming).unwrap();
    add_chain(&rx, 0, &[(0x20_0000, 2048, true)]);
    assert_eq!(n.process_rx(), 1);
    assert_eq!(used(&rx, 0), (0, incoming.len() as u32));
    let mut delivered = vec![0u8; incoming.len()];
    mem.read_slice(&mut delivered, GuestAddress(0x20_0000))
        .unwrap();
    // The device fills in num_buffers (one buffer per frame without MRG_RXBUF).
    assert_eq!(&delivered[10..12], &1u16.to_le_bytes());
    assert_eq!(delivered[12..], incoming[12..]);

    // A frame larger than the guest's buffer is dropped, not truncated.
    let mut big = vec![0u8; VNET_HDR_LEN];
    big.extend_from_slice(&[7u8; 1000]);
    host.send(&big).unwrap();
    add_chain(&rx, 1, &[(0x20_0000, 64, true)]);
    n.process_rx();
    assert_eq!(n.stats().rx_dropped, 1, "{:?}", n.stats());
}

#[test]
fn state_round_trips_with_the_mac() {
    let Some(mut n) = net("vns", Some([2, 0, 0, 0, 0, 9])) else {
        return;
    };
    let mem = memory(4);
    let rx = mock_queue(&mem, GuestAddress(0));
    let tx = mock_queue(&mem, GuestAddress(0x1_0000));
    activate(&mut n, &mem, &[&rx, &tx]);
    let state: NetState =
        serde_json::from_str(&serde_json::to_string(&n.save().unwrap()).unwrap()).unwrap();
    let tap = n.tap.name().to_string();
    drop(n);
    let restored = Net::restore(
        NetConstructorArgs {
            tap,
            limits: Default::default(),
            mem,
            interrupt: interrupt(),
        },
        &state,
    )
    .unwrap();
    assert!(restored.is_activated());
    let mut mac = [0u8; 6];
    restored.read_config(0, &mut mac);
    assert_eq!(mac, [2, 0, 0, 0, 0, 9]);
}

#[test]
fn throttled_tx_frames_stay_in_the_ring_and_rx_frames_stay_pending() {
    use crate::devices::virtio::test_utils::wait_for_timer;
    use vmm_api::rate_limit::{IoLimit, NetLimits, RateLimit};
    let (mut n, host) = net_on_socketpair();
    host.set_nonblocking(true).unwrap();
    // Transmit: one frame per 20 ms. Receive: 100 bytes per 20 ms.
    let every_20ms = |size| RateLimit {
        size,
        burst: 0,
        refill_ms: 20,
    };
    n.set_limits(&NetLimits {
        rx: IoLimit {
            bandwidth: Some(every_20ms(100)),
            ops: None,
        },
        tx: IoLimit {
            bandwidth: None,
            ops: Some(every_20ms(1)),
        },
    })
    .unwrap();
    let mem = memory(4);
    let rx = mock_queue(&mem, GuestAddress(0));
    let tx = mock_queue(&mem, GuestAddress(0x1_0000));
    activate(&mut n, &mem, &[&rx, &tx]);
    let counters = n.io_counters();

    mem.write_slice(&[0u8; VNET_HDR_LEN + 60], GuestAddress(0x10_0000))
        .unwrap();
    let frame = (0x10_0000, (VNET_HDR_LEN + 60) as u32, false);
    add_chain(&tx, 0, &[frame]);
    add_chain(&tx, 1, &[frame]);
    assert_eq!(n.process_tx(), 1);
    assert_eq!(used_idx(&tx), 1);
    let mut got = [0u8; 2048];
    assert_eq!(host.recv(&mut got).unwrap(), VNET_HDR_LEN + 60);
    assert!(host.recv(&mut got).is_err(), "the second frame waits");
    assert_eq!(n.process_tx(), 0, "not even on a notification");
    assert_eq!(counters.read().tx_throttled, 1);
    wait_for_timer(n.tx_limiter.timer_fd().unwrap());
    n.tx_limiter.timer_fired();
    assert_eq!(n.process_tx(), 1);
    assert_eq!(used(&tx, 1), (1, 0));
    assert_eq!(host.recv(&mut got).unwrap(), VNET_HDR_LEN + 60);

    // Two 80-byte frames through a 100-byte bucket: the second stays pending.
    let mut incoming = vec![0u8; VNET_HDR_LEN];
    incoming.extend_from_slice(&[5u8; 80]);
    host.send(&incoming).unwrap();
    host.send(&incoming).unwrap();
    add_chain(&rx, 0, &[(0x20_0000, 2048, true)]);
    add_chain(&rx, 1, &[(0x30_0000, 2048, true)]);
    assert_eq!(n.process_rx(), 1);
    assert_eq!(used_idx(&rx), 1);
    assert_eq!(n.rx_pending, Some(VNET_HDR_LEN + 80));
    assert_eq!(counters.read().rx_throttled, 1);
    wait_for_timer(n.rx_limiter.timer_fd().unwrap());
    n.rx_limiter.timer_fired();
    assert_eq!(n.process_rx(), 1);
    assert_eq!(used(&rx, 1), (1, (VNET_HDR_LEN + 80) as u32));
    assert_eq!(n.rx_pending, None);

    assert_eq!(
        counters.read(),
        vmm_api::protocol::NetCounters {
            rx_bytes: 160,
            rx_packets: 2,
            tx_bytes: 120,
            tx_packets: 2,
            rx_throttled: 1,
            tx_throttled: 1,
        }
    );
}
