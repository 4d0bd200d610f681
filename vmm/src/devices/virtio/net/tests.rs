use vm_memory::GuestAddress;

use super::persist::{NetConstructorArgs, NetState};
use super::*;
use crate::devices::virtio::test_utils::{
    activate, add_chain, interrupt, memory, mock_queue, used, used_idx,
};
use crate::snapshot::persist::Persist;

/// A tap device for the test, or `None` (with the reason printed) without CAP_NET_ADMIN.
fn net(name: &str, mac: Option<[u8; 6]>) -> Option<Net> {
    let name = format!("{name}{}", std::process::id() % 10_000);
    match Net::new(&name, mac) {
        Ok(n) => Some(n),
        Err(e) => {
            println!("SKIPPED: cannot create tap {name}: {e}");
            None
        }
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
