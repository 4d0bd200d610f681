//! Group `virtio`: one guest with every device the vmm offers (two disks,
//! one read-only; rng; net on a tap; vsock), driven by the guest kernel's
//! own drivers; each device is a scenario judged from that one run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use vmm_api::command::{DiskSpec, NetSpec};
use vmm_api::VsockSpec;

use super::checks::bad_kernel_messages;
use super::{probe_args, Fixtures, BASE_CMDLINE};
use crate::inner::net::{self, AckServer, Tap};
use crate::inner::vm::Guest;
use crate::inner::vsock::{self, Received};
use crate::inner::{Check, Ctx};

/// Bytes sent each way over vsock.
const VSOCK_BYTES: usize = 10 << 20;
const LIMIT: Duration = Duration::from_secs(600);

/// What the one virtio guest run left behind.
pub struct VirtioRun {
    lines: Vec<String>,
    ended: Result<(), String>,
    rw_disk: PathBuf,
    ro_disk: PathBuf,
    ro_sha_before: String,
    received: Result<Received, String>,
    sent_sha: Result<String, String>,
    tcp_served: usize,
    secs: f64,
}

/// The tap and the TCP server a group's guests talk to.
pub fn network(fx: &mut Fixtures) -> Result<(String, usize), String> {
    if fx.network.is_none() {
        let tap = Tap::create("rgtap0")?;
        let server = AckServer::start()?;
        fx.network = Some((tap, server));
    }
    let (tap, server) = fx.network.as_ref().ok_or("network fixture missing")?;
    Ok((tap.name.clone(), server.count()))
}

fn file_sha(path: &Path) -> Result<String, String> {
    std::fs::read(path)
        .map(|d| vsock::sha256(&d))
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn the_run(ctx: &mut Ctx) -> Result<&VirtioRun, String> {
    if ctx.fixtures.virtio.is_none() {
        let run = run_guest(ctx)?;
        ctx.fixtures.virtio = Some(run);
    }
    ctx.fixtures
        .virtio
        .as_ref()
        .ok_or_else(|| "no virtio run".into())
}

fn run_guest(ctx: &mut Ctx) -> Result<VirtioRun, String> {
    let t0 = Instant::now();
    let (tap, served_before) = network(&mut ctx.fixtures)?;
    let rw_disk = ctx.scratch.join("virtio-rw.ext4");
    let ro_disk = ctx.scratch.join("virtio-ro.ext4");
    for d in [&rw_disk, &ro_disk] {
        std::fs::copy(&ctx.env.test_disk, d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    let ro_sha_before = file_sha(&ro_disk)?;
    let uds = ctx.scratch.join("virtio.vsock");
    let receiver = vsock::receive_one(&uds, 5000, LIMIT)?;
    let kernel = ctx.env.cloud.vmlinux.clone().ok_or("no cloud vmlinux")?;
    let cmdline = format!(
        "{BASE_CMDLINE} rg.mode=virtio rg.ip={} rg.peer={}",
        net::GUEST_CIDR,
        net::HOST_IP
    );
    // One vCPU: the drivers are what this group checks. With two, the outer
    // VM's emulated nested paging has failed the guest's vCPU 1 (a livelock
    // on QEMU 7.2, a triple fault once in four runs on QEMU 10; README, "The
    // outer VM's QEMU"); SMP is the boot group's subject.
    let mut args = probe_args(&kernel, &ctx.env.cloud.probe_initrd, 1, &cmdline);
    args.devices.disks = vec![DiskSpec::rw(&rw_disk), DiskSpec::ro(ro_disk.clone())];
    args.devices.rng = true;
    args.devices.net = Some(NetSpec::tap(tap));
    args.devices.vsock = Some(VsockSpec {
        cid: 3,
        uds: uds.clone(),
    });
    let mut g = Guest::start(ctx, "virtio", args)?;
    let mut sent_sha = Err("the guest never listened on vsock port 1024".to_string());
    let mut ended = g.wait_for("RG-VSOCK-LISTENING", LIMIT).map(|_| ());
    if ended.is_ok() {
        sent_sha = vsock::random_bytes(VSOCK_BYTES).and_then(|data| {
            vsock::send_all(&uds, 1024, &data, Duration::from_secs(300))?;
            Ok(vsock::sha256(&data))
        });
        ended = g
            .wait_for("RG-DONE", LIMIT)
            .and_then(|_| g.expect_clean_exit(Duration::from_secs(120)))
            .map(|_| ());
    }
    let received = receiver
        .join()
        .unwrap_or_else(|_| Err("the vsock listener thread panicked".into()));
    let tcp_served = ctx
        .fixtures
        .network
        .as_ref()
        .map_or(0, |(_, s)| s.count() - served_before);
    Ok(VirtioRun {
        lines: g.lines(),
        ended,
        rw_disk,
        ro_disk,
        ro_sha_before,
        received,
        sent_sha,
        tcp_served,
        secs: t0.elapsed().as_secs_f64(),
    })
}

/// The value after `key ` in the guest's output.
fn said(run: &VirtioRun, key: &str) -> String {
    let prefix = format!("{key} ");
    run.lines
        .iter()
        .find_map(|l| l.split_once(&prefix).map(|(_, v)| v.trim().to_string()))
        .unwrap_or_default()
}

/// The run, failed if the guest itself did not get through it.
fn judged(ctx: &mut Ctx) -> Result<&VirtioRun, String> {
    let run = the_run(ctx)?;
    run.ended
        .clone()
        .map_err(|e| format!("the virtio guest did not finish: {e}"))?;
    let bad = bad_kernel_messages(&run.lines);
    if !bad.is_empty() {
        return Err(format!("kernel warnings: {}", bad.join(" / ")));
    }
    Ok(run)
}

fn bound(run: &VirtioRun, device_id: u32, driver: &str) -> Result<(), String> {
    let want = format!("device=0x{device_id:04x} driver={driver}");
    if run
        .lines
        .iter()
        .any(|l| l.contains("RG-VIRTIO") && l.contains(&want))
    {
        Ok(())
    } else {
        Err(format!(
            "no virtio device {device_id} bound to {driver}; the guest saw: {:?}",
            run.lines
                .iter()
                .filter(|l| l.contains("RG-VIRTIO"))
                .collect::<Vec<_>>()
        ))
    }
}

/// virtio-blk read-write: ext4 mounted, read, 4 MiB written and fsynced,
/// unmounted; the host finds the same bytes and a clean file system.
pub fn blk(ctx: &mut Ctx, _name: &str) -> Check {
    let run = judged(ctx)?;
    bound(run, 2, "virtio_blk")?;
    // Found through the ACPI DSDT: nothing on the command line.
    let cmdline = super::checks::fact(&run.lines, "cmdline").unwrap_or_default();
    if cmdline.contains("virtio_mmio.device") {
        return Err(format!(
            "the devices were announced on the command line: {cmdline}"
        ));
    }
    let read = said(run, "RG-BLK-READ");
    if !read.contains("hello from an ext4 image made on the host") {
        return Err(format!("the guest read {read:?} from hello.txt"));
    }
    if said(run, "RG-BLK-UMOUNT") != "ok" {
        return Err("the guest could not unmount the disk".into());
    }
    let wrote = said(run, "RG-BLK-WROTE");
    let dump = run.rw_disk.with_extension("fromguest");
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(format!("dump /fromguest.bin {}", dump.display()))
        .arg(&run.rw_disk)
        .output()
        .map_err(|e| format!("debugfs: {e}"))?;
    let host = file_sha(&dump).map_err(|e| {
        format!(
            "{e} (debugfs: {})",
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })?;
    if host != wrote {
        return Err(format!(
            "the guest wrote sha256 {wrote}, the host reads {host}"
        ));
    }
    let fsck = Command::new("e2fsck")
        .arg("-fn")
        .arg(&run.rw_disk)
        .output()
        .map_err(|e| format!("e2fsck: {e}"))?;
    if !fsck.status.success() {
        return Err(format!(
            "e2fsck after the guest: {}",
            String::from_utf8_lossy(&fsck.stdout).trim()
        ));
    }
    Ok(format!(
        "ext4 read, 4 MiB written (sha256 {} on the host too), e2fsck clean; guest ran {:.0} s",
        &wrote[..12.min(wrote.len())],
        run.secs
    ))
}

/// virtio-blk read-only: the guest sees a read-only disk, its write is
/// refused, it reads the host's bytes, and the file is unchanged.
pub fn blk_read_only(ctx: &mut Ctx, _name: &str) -> Check {
    let run = judged(ctx)?;
    let flag = said(run, "RG-BLK-RO-FLAG");
    if flag != "1" {
        return Err(format!("/sys/block/vdb/ro is {flag:?}, not 1"));
    }
    let write = said(run, "RG-BLK-RO-WRITE");
    if write != "refused" {
        return Err(format!("a write to the read-only disk {write}"));
    }
    let host = std::fs::read(&run.ro_disk).map_err(|e| e.to_string())?;
    let first = vsock::sha256(&host[..4096.min(host.len())]);
    let read = said(run, "RG-BLK-RO-READ");
    if read != first {
        return Err(format!(
            "the guest read sha256 {read}, the host's first 4 KiB are {first}"
        ));
    }
    if vsock::sha256(&host) != run.ro_sha_before {
        return Err("the read-only disk's file changed".into());
    }
    Ok("read-only flag set, write refused, reads match, file unchanged".into())
}

/// virtio-rng: /dev/hwrng is virtio_rng and gives bytes.
pub fn rng(ctx: &mut Ctx, _name: &str) -> Check {
    let run = judged(ctx)?;
    bound(run, 4, "virtio_rng")?;
    let said = said(run, "RG-RNG");
    let (current, bytes) = said.split_once(' ').unwrap_or((&said, ""));
    if !current.starts_with("virtio_rng") {
        return Err(format!("rng_current is {current:?}"));
    }
    if bytes.len() != 64 || bytes.chars().all(|c| c == '0') {
        return Err(format!("/dev/hwrng gave {bytes:?}"));
    }
    Ok(format!("{current}: {}…", &bytes[..16]))
}

/// virtio-net: the guest pings the outer VM over the tap and gets an
/// answer from a TCP server there.
pub fn net(ctx: &mut Ctx, _name: &str) -> Check {
    let run = judged(ctx)?;
    bound(run, 1, "virtio_net")?;
    let ping = said(run, "RG-NET-PING");
    if ping != "ok" {
        return Err(format!("ping {}: {ping}", net::HOST_IP));
    }
    let tcp = said(run, "RG-NET-TCP");
    if !tcp.contains("ack hello-from-guest") || run.tcp_served == 0 {
        return Err(format!(
            "TCP to {}:{}: the guest got {tcp:?}, the server answered {} connection(s)",
            net::HOST_IP,
            net::TCP_PORT,
            run.tcp_served
        ));
    }
    Ok(format!("ping and TCP to {} over the tap", net::HOST_IP))
}

/// virtio-vsock: 10 MiB guest->host and 10 MiB host->guest, checked by hash.
pub fn vsock(ctx: &mut Ctx, _name: &str) -> Check {
    let run = judged(ctx)?;
    bound(run, 19, "vmw_vsock_virtio_transport")?;
    let received = run
        .received
        .as_ref()
        .map_err(|e| format!("guest->host: {e}"))?;
    let g2h_sent = said(run, "RG-VSOCK-G2H-SENT");
    if received.len != VSOCK_BYTES || received.sha256 != g2h_sent {
        return Err(format!(
            "guest->host: the guest sent sha256 {g2h_sent}, the host got {} bytes with {}",
            received.len, received.sha256
        ));
    }
    let reply = said(run, "RG-VSOCK-G2H-REPLY");
    if reply != format!("ok {g2h_sent}") {
        return Err(format!("guest->host: the guest read {reply:?} back"));
    }
    let sent = run
        .sent_sha
        .as_ref()
        .map_err(|e| format!("host->guest: {e}"))?;
    let got = said(run, "RG-VSOCK-H2G-GOT");
    let want = format!("rc=0 bytes={VSOCK_BYTES} sha256={sent}");
    if !got.starts_with(&want) {
        return Err(format!(
            "host->guest: the guest reports {got:?}, expected {want}"
        ));
    }
    Ok("10 MiB each way, hashes match".into())
}
