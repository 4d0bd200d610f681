//! The i8042 under real KVM: a test guest runs Linux's probe sequence by
//! polling the controller and reports every byte it read.

mod common;

use common::*;

#[test]
fn linux_probe_sequence_gets_the_controller_and_keyboard_replies() {
    let g = guest("i8042_probe");
    let out = run_vmm(&["run", "--kernel", g.to_str().unwrap()]);
    let text = stdout(&out);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout: {text}\nstderr: {}",
        stderr(&out)
    );
    let kvs = kv_lines(&text);
    let expected = [
        ("flush", "0"),
        ("selftest", "0x55"),
        // Translation on, AUX port off, POST passed, keyboard interrupt on.
        ("ctr", "0x65 0x65"),
        ("keylock", "off"),
        ("sysflag", "1"),
        ("ctr_init", "0x74"),
        ("kbd_test", "0x0"),
        ("ctr_enabled", "0x65"),
        ("kbd_reset", "0xfa 0xaa"),
        // An MF2 keyboard's id as a translating controller passes it on.
        ("kbd_id", "0xfa 0xab 0x41"),
        ("kbd_echo", "0xee"),
        ("aux_loop", "0x5a"),
        ("aux_loop.auxdata", "1"),
        ("outport", "0xcf"),
    ];
    for (key, value) in expected {
        assert_eq!(kv(&kvs, key), value, "{key}; guest output:\n{text}");
    }
    let flushes: Vec<&str> = kvs
        .iter()
        .filter(|(k, _)| k == "flush")
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(flushes, ["0", "0", "0"], "nothing left over: {text}");
    assert!(text.ends_with("i8042: end\n"), "{text}");
}
