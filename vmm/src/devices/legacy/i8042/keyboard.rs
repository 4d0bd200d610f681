//! The PS/2 keyboard behind the i8042's first port. It answers the commands
//! a driver sends it (reset, identify, scanning on and off, LEDs, typematic
//! rate, scan-code set, echo, resend) as an MF2 keyboard does; it never has
//! keys to report.

/// Command acknowledged.
pub const ACK: u8 = 0xfa;
/// Command not understood: send it again.
pub const RESEND: u8 = 0xfe;
/// Basic assurance test passed (sent after a reset).
pub const SELF_TEST_PASSED: u8 = 0xaa;
/// Reply to an echo.
pub const ECHO: u8 = 0xee;
/// First identify byte of an MF2 keyboard.
pub const ID_FIRST: u8 = 0xab;
/// Second identify byte, as the keyboard sends it and as a translating
/// controller passes it on.
const ID_SECOND: u8 = 0x83;
const ID_SECOND_TRANSLATED: u8 = 0x41;

const CMD_SET_LEDS: u8 = 0xed;
const CMD_ECHO: u8 = 0xee;
const CMD_SCANCODE_SET: u8 = 0xf0;
const CMD_IDENTIFY: u8 = 0xf2;
const CMD_TYPEMATIC: u8 = 0xf3;
const CMD_ENABLE: u8 = 0xf4;
const CMD_DISABLE: u8 = 0xf5;
const CMD_DEFAULTS: u8 = 0xf6;
/// Scan-code set 3 key-type commands: acknowledged, nothing else to do.
const CMD_SET3_FIRST: u8 = 0xf7;
const CMD_SET3_LAST: u8 = 0xfd;
const CMD_RESEND: u8 = 0xfe;
const CMD_RESET: u8 = 0xff;
/// Bytes from here up are commands, even where a parameter was expected.
const FIRST_COMMAND: u8 = CMD_SET_LEDS;

/// 10.9 characters a second after 500 ms.
const DEFAULT_TYPEMATIC: u8 = 0x2b;
const DEFAULT_SCANCODE_SET: u8 = 2;
/// Scan-code set numbers 1..=3 as a translating controller passes them on.
const TRANSLATED_SET: [u8; 3] = [0x43, 0x41, 0x3f];

/// The keyboard's settings and the command waiting for its parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keyboard {
    /// Whether it would report keys (0xF4 on, 0xF5 off).
    pub scanning: bool,
    /// Scan-code set, 1 to 3.
    pub scancode_set: u8,
    /// LED bits (scroll, num, caps lock).
    pub leds: u8,
    /// Typematic rate and delay.
    pub typematic: u8,
    /// 0xED, 0xF0 or 0xF3 when the next byte is that command's parameter.
    pub awaiting: Option<u8>,
    /// The last byte sent, for 0xFE (resend).
    pub last_sent: u8,
}

impl Default for Keyboard {
    fn default() -> Self {
        Keyboard {
            scanning: true,
            scancode_set: DEFAULT_SCANCODE_SET,
            leds: 0,
            typematic: DEFAULT_TYPEMATIC,
            awaiting: None,
            last_sent: 0,
        }
    }
}

impl Keyboard {
    /// Whether `cmd` takes a parameter byte (the states `awaiting` may hold).
    pub fn takes_parameter(cmd: u8) -> bool {
        matches!(cmd, CMD_SET_LEDS | CMD_SCANCODE_SET | CMD_TYPEMATIC)
    }

    /// Takes one byte from the driver and returns the keyboard's reply.
    /// `translated`: the controller translates what the keyboard sends.
    pub fn receive(&mut self, byte: u8, translated: bool) -> Vec<u8> {
        let reply = match self.awaiting.take() {
            Some(cmd) if byte < FIRST_COMMAND => self.parameter(cmd, byte, translated),
            _ => self.command(byte, translated),
        };
        if let Some(&last) = reply.last() {
            self.last_sent = last;
        }
        reply
    }

    fn command(&mut self, cmd: u8, translated: bool) -> Vec<u8> {
        match cmd {
            CMD_RESET => {
                *self = Keyboard::default();
                vec![ACK, SELF_TEST_PASSED]
            }
            CMD_RESEND => vec![self.last_sent],
            CMD_DEFAULTS => {
                self.set_defaults();
                vec![ACK]
            }
            CMD_DISABLE => {
                self.set_defaults();
                self.scanning = false;
                vec![ACK]
            }
            CMD_ENABLE => {
                self.scanning = true;
                vec![ACK]
            }
            CMD_IDENTIFY => {
                let second = if translated {
                    ID_SECOND_TRANSLATED
                } else {
                    ID_SECOND
                };
                vec![ACK, ID_FIRST, second]
            }
            CMD_ECHO => vec![ECHO],
            CMD_SET_LEDS | CMD_SCANCODE_SET | CMD_TYPEMATIC => {
                self.awaiting = Some(cmd);
                vec![ACK]
            }
            CMD_SET3_FIRST..=CMD_SET3_LAST => vec![ACK],
            _ => vec![RESEND],
        }
    }

    fn parameter(&mut self, cmd: u8, value: u8, translated: bool) -> Vec<u8> {
        match cmd {
            CMD_SET_LEDS => {
                self.leds = value & 0x07;
                vec![ACK]
            }
            CMD_TYPEMATIC => {
                self.typematic = value & 0x7f;
                vec![ACK]
            }
            CMD_SCANCODE_SET => match value {
                0 => {
                    let set = self.scancode_set;
                    let reported = if translated {
                        TRANSLATED_SET[usize::from(set.clamp(1, 3) - 1)]
                    } else {
                        set
                    };
                    vec![ACK, reported]
                }
                1..=3 => {
                    self.scancode_set = value;
                    vec![ACK]
                }
                _ => vec![RESEND],
            },
            _ => vec![RESEND],
        }
    }

    fn set_defaults(&mut self) {
        self.scancode_set = DEFAULT_SCANCODE_SET;
        self.typematic = DEFAULT_TYPEMATIC;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_acks_passes_its_self_test_and_restores_defaults() {
        let mut kbd = Keyboard::default();
        assert_eq!(kbd.receive(0xf5, false), [ACK]);
        assert!(!kbd.scanning);
        assert_eq!(kbd.receive(0xff, false), [ACK, SELF_TEST_PASSED]);
        assert_eq!(
            kbd,
            Keyboard {
                last_sent: SELF_TEST_PASSED,
                ..Keyboard::default()
            }
        );
    }

    #[test]
    fn identify_reports_an_mf2_keyboard_translated_or_not() {
        let mut kbd = Keyboard::default();
        assert_eq!(kbd.receive(0xf2, false), [ACK, 0xab, 0x83]);
        assert_eq!(kbd.receive(0xf2, true), [ACK, 0xab, 0x41]);
    }

    #[test]
    fn parameter_commands_take_the_next_byte() {
        let mut kbd = Keyboard::default();
        assert_eq!(kbd.receive(0xed, false), [ACK]);
        assert_eq!(kbd.receive(0x07, false), [ACK]);
        assert_eq!(kbd.leds, 7);
        assert_eq!(kbd.receive(0xf3, false), [ACK]);
        assert_eq!(kbd.receive(0x00, false), [ACK]);
        assert_eq!(kbd.typematic, 0);
        assert_eq!(kbd.receive(0xf0, false), [ACK]);
        assert_eq!(kbd.receive(0x03, false), [ACK]);
        assert_eq!(kbd.receive(0xf0, false), [ACK]);
        assert_eq!(kbd.receive(0x00, false), [ACK, 3]);
        assert_eq!(kbd.receive(0xf0, true), [ACK]);
        assert_eq!(kbd.receive(0x00, true), [ACK, 0x3f]);
        assert_eq!(kbd.receive(0xf0, false), [ACK]);
        assert_eq!(kbd.receive(0x09, false), [RESEND], "no set 9");
        assert_eq!(kbd.awaiting, None);
    }

    #[test]
    fn a_command_byte_where_a_parameter_was_expected_is_a_command() {
        let mut kbd = Keyboard::default();
        assert_eq!(kbd.receive(0xed, false), [ACK]);
        assert_eq!(kbd.receive(0xee, false), [ECHO]);
        assert_eq!(kbd.awaiting, None);
        assert_eq!(kbd.leds, 0);
    }

    #[test]
    fn echo_resend_and_unknown_bytes() {
        let mut kbd = Keyboard::default();
        assert_eq!(kbd.receive(0xee, false), [ECHO]);
        assert_eq!(
            kbd.receive(0xfe, false),
            [ECHO],
            "resend repeats the last byte"
        );
        assert_eq!(kbd.receive(0xf4, false), [ACK]);
        assert!(kbd.scanning);
        assert_eq!(
            kbd.receive(0xfa, false),
            [ACK],
            "set-3 commands are acknowledged"
        );
        assert_eq!(kbd.receive(0x42, false), [RESEND], "not a command");
        assert_eq!(kbd.receive(0xef, false), [RESEND]);
    }
}
