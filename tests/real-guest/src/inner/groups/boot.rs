//! Group `boot`: Debian's cloud kernel with the probe initramfs boots to
//! user space under the vmm, and the kernel's view of the machine is what
//! the vmm was asked for.

use std::path::Path;
use std::time::Duration;

use super::checks::{bad_kernel_messages, fact};
use super::{probe_args as args, BASE_CMDLINE, PROBE_MEM_MIB};
use crate::inner::vm::Guest;
use crate::inner::{Check, Ctx};

/// Longest a probe boot may take to reach user space and end (nested
/// emulation: 11-30 s measured; generous for a loaded host).
const BOOT_LIMIT: Duration = Duration::from_secs(300);
const MEM_MIB: u64 = PROBE_MEM_MIB;

fn cloud_vmlinux(ctx: &Ctx) -> Result<std::path::PathBuf, String> {
    ctx.env
        .cloud
        .vmlinux
        .clone()
        .ok_or_else(|| "no cloud vmlinux was prepared".to_string())
}

/// Boots the probe in `mode` and waits for the vmm to exit cleanly; returns
/// the console lines.
fn boot_probe(
    ctx: &Ctx,
    name: &str,
    kernel: &Path,
    vcpus: u8,
    options: &str,
) -> Result<(Vec<String>, String), String> {
    let cmdline = format!("{BASE_CMDLINE} {options}");
    let mut g = Guest::start(
        ctx,
        name,
        args(kernel, &ctx.env.cloud.probe_initrd, vcpus, &cmdline),
    )?;
    let booted = g.wait_for("RG-BOOTED", BOOT_LIMIT)?;
    g.wait_for("RG-DONE", BOOT_LIMIT)?;
    g.expect_clean_exit(Duration::from_secs(120))?;
    Ok((g.lines(), format!("{cmdline}|{booted}")))
}

/// Boot with `vcpus` and check the kernel's view: command line, memory,
/// CPUs, clock source, interrupts, and no warnings.
pub fn boot_vcpus(ctx: &mut Ctx, name: &str, vcpus: u8) -> Check {
    let kernel = cloud_vmlinux(ctx)?;
    let (lines, meta) = boot_probe(ctx, name, &kernel, vcpus, "rg.mode=boot")?;
    let (cmdline, booted) = meta.split_once('|').unwrap_or((&meta, ""));
    let mut problems = Vec::new();
    let seen_cmdline = fact(&lines, "cmdline").unwrap_or_default();
    // Exactly: with ACPI the vmm appends nothing (no virtio_mmio.device=).
    if seen_cmdline != cmdline {
        problems.push(format!(
            "/proc/cmdline is {seen_cmdline:?}, the vmm was given {cmdline:?}"
        ));
    }
    let nproc = fact(&lines, "nproc").unwrap_or_default();
    if nproc != vcpus.to_string() {
        problems.push(format!("the guest sees {nproc:?} CPUs, not {vcpus}"));
    }
    let mem_kb: u64 = fact(&lines, "memtotal_kb")
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    // The kernel keeps its own image and early allocations out of MemTotal.
    let (lo, hi) = (MEM_MIB * 1024 * 80 / 100, MEM_MIB * 1024);
    if !(lo..=hi).contains(&mem_kb) {
        problems.push(format!(
            "MemTotal is {mem_kb} kB, expected {lo}..{hi} for {MEM_MIB} MiB"
        ));
    }
    let clock = fact(&lines, "clocksource").unwrap_or_default();
    if clock != "kvm-clock" {
        problems.push(format!("clock source is {clock:?}, not kvm-clock"));
    }
    if vcpus > 1 {
        // Every CPU takes local APIC timer interrupts.
        let loc = lines
            .iter()
            .filter_map(|l| l.split_once("RG-IRQ: ").map(|(_, r)| r.trim()))
            .find(|r| r.starts_with("LOC:"));
        match loc {
            Some(r) => {
                let counts: Vec<u64> = r
                    .split_whitespace()
                    .skip(1)
                    .take(usize::from(vcpus))
                    .filter_map(|c| c.parse().ok())
                    .collect();
                if counts.len() != usize::from(vcpus) || counts.contains(&0) {
                    problems.push(format!("local APIC timer counts per CPU: {r}"));
                }
            }
            None => problems.push("no LOC line in /proc/interrupts".into()),
        }
    }
    let bad = bad_kernel_messages(&lines);
    if !bad.is_empty() {
        problems.push(format!("kernel warnings: {}", bad.join(" / ")));
    }
    if problems.is_empty() {
        Ok(format!(
            "{nproc} CPU(s), {} MiB, {clock}; {}",
            mem_kb / 1024,
            booted.trim()
        ))
    } else {
        Err(problems.join("; "))
    }
}

/// `--acpi off`: no ACPI tables, the MP table alone describes the CPUs; the
/// generic kernel (which parses it) sees both vCPUs.
pub fn mptable(ctx: &mut Ctx, name: &str) -> Check {
    let kernel = ctx.env.generic.bzimage.clone();
    let cmdline = format!("{BASE_CMDLINE} rg.mode=boot");
    let mut a = args(&kernel, &ctx.env.generic.probe_initrd, 2, &cmdline);
    a.acpi = Some(false);
    let mut g = Guest::start(ctx, name, a)?;
    g.wait_for("RG-DONE", BOOT_LIMIT)?;
    g.expect_clean_exit(Duration::from_secs(120))?;
    let lines = g.lines();
    let nproc = fact(&lines, "nproc").unwrap_or_default();
    if nproc != "2" {
        return Err(format!(
            "the guest sees {nproc:?} CPUs from the MP table, not 2"
        ));
    }
    let acpi: Vec<&String> = lines.iter().filter(|l| l.starts_with("RG-ACPI")).collect();
    if !acpi.is_empty() {
        return Err(format!("ACPI devices with --acpi off: {acpi:?}"));
    }
    Ok(format!(
        "{nproc} CPUs from the MP table, no ACPI ({})",
        ctx.env.generic.version
    ))
}

/// The bzImage of the same kernel (64-bit boot protocol entry) boots too.
pub fn bzimage(ctx: &mut Ctx, name: &str) -> Check {
    let kernel = ctx.env.cloud.bzimage.clone();
    let (lines, _) = boot_probe(ctx, name, &kernel, 1, "rg.mode=boot")?;
    let bad = bad_kernel_messages(&lines);
    if !bad.is_empty() {
        return Err(format!("kernel warnings: {}", bad.join(" / ")));
    }
    Ok(fact(&lines, "nproc")
        .map(|n| format!("{n} CPU"))
        .unwrap_or_default())
}

/// A guest powering off (ACPI S5) makes the vmm exit 0, like a reset.
pub fn poweroff(ctx: &mut Ctx, name: &str) -> Check {
    let kernel = cloud_vmlinux(ctx)?;
    boot_probe(ctx, name, &kernel, 1, "rg.mode=boot rg.end=poweroff")?;
    Ok("the vmm exited 0 on the guest's power-off".into())
}

/// Serial input written before the guest's UART is set up is discarded
/// with the FIFO when the driver resets it; what the host writes once the
/// guest listens arrives whole.
pub fn serial_input(ctx: &mut Ctx, name: &str) -> Check {
    let kernel = cloud_vmlinux(ctx)?;
    let cmdline = format!("{BASE_CMDLINE} rg.mode=serial");
    let mut g = Guest::start(
        ctx,
        name,
        args(&kernel, &ctx.env.cloud.probe_initrd, 1, &cmdline),
    )?;
    // More than the 64-byte FIFO holds, written at once before the kernel
    // has even started its serial driver.
    let early: String = (0..10).map(|i| format!("early-{i}\n")).collect();
    g.send(&early)?;
    let (at, _) = g.wait_from(0, "RG-SERIAL-READY", BOOT_LIMIT)?;
    let mut got = Vec::new();
    for i in 1..=3 {
        g.send(&format!("ping-{i}\n"))?;
        let (_, line) = g
            .wait_from(
                at,
                &format!("RG-SERIAL-GOT ping-{i}"),
                Duration::from_secs(60),
            )
            .map_err(|e| format!("{e}; the guest read: {:?}", g.lines_with("RG-SERIAL-GOT")))?;
        got.push(line);
    }
    g.wait_for("RG-DONE", Duration::from_secs(60))?;
    g.expect_clean_exit(Duration::from_secs(60))?;
    let read: Vec<String> = g
        .lines_with("RG-SERIAL-GOT")
        .into_iter()
        .map(|l| {
            l.split_once("RG-SERIAL-GOT ")
                .map(|x| x.1.to_string())
                .unwrap_or(l)
        })
        .collect();
    if read != ["ping-1", "ping-2", "ping-3"] {
        return Err(format!(
            "the guest read {read:?}: input written before its UART was set up leaked through"
        ));
    }
    Ok("early input discarded at the FIFO reset; 3 lines arrived whole".into())
}
