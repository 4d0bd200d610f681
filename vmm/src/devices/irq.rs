//! Interrupt lines: an eventfd registered with KVM as an irqfd for one GSI,
//! usable as a vm-superio `Trigger`.

use vmm_sys_util::eventfd::EventFd;

/// One guest interrupt line backed by an irqfd.
#[derive(Debug)]
pub struct IrqLine {
    evt: EventFd,
    gsi: u32,
}

impl IrqLine {
    /// Creates a line for `gsi`; register `eventfd()` with KVM before the guest runs.
    pub fn new(gsi: u32) -> std::io::Result<Self> {
        Ok(IrqLine {
            evt: EventFd::new(libc::EFD_NONBLOCK)?,
            gsi,
        })
    }

    /// The eventfd to register as an irqfd.
    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }

    /// The GSI this line raises.
    pub fn gsi(&self) -> u32 {
        self.gsi
    }
}

impl vm_superio::Trigger for IrqLine {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.evt.write(1)
    }
}
