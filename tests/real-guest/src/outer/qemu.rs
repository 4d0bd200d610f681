//! The outer VM (L1): QEMU in software emulation (TCG) with an emulated AMD
//! CPU that has SVM and nested paging, so Debian's kernel in it gets a
//! `/dev/kvm` that behaves like hardware. Its console is read line by line.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;

/// How the outer VM is started.
#[derive(Debug, Clone)]
pub struct L1Options {
    /// QEMU binary.
    pub qemu: PathBuf,
    /// vCPUs.
    pub smp: u32,
    /// Memory, MiB.
    pub mem_mib: u32,
    /// TCG thread mode: `multi` (a host thread per vCPU) or `single`.
    pub tcg_thread: String,
    /// CPU model (`max`, or e.g. `EPYC` with SVM).
    pub cpu: String,
}

/// A running outer VM.
pub struct L1 {
    child: Child,
    /// Console lines, as they arrive; closed when QEMU's output ends.
    pub lines: mpsc::Receiver<String>,
}

impl L1 {
    /// Starts QEMU with `kernel`, `initrd`, the host's / shared read-only
    /// and `work` shared read-write; L1's init runs `script` (a path under
    /// `work`). L1 puts its own memory-backed /tmp, /run and /var/tmp over
    /// the host's; the host directories in `keep` (the checkout, the cache)
    /// stay visible wherever they are. The console is copied to `log`.
    pub fn start(
        opts: &L1Options,
        kernel: &Path,
        initrd: &Path,
        work: &Path,
        keep: &[PathBuf],
        script: &Path,
        log: &Path,
    ) -> std::io::Result<L1> {
        for p in keep.iter().map(|p| p.as_path()).chain([work, script]) {
            if p.to_str()
                .is_none_or(|s| s.contains(char::is_whitespace) || s.contains(','))
            {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "{}: the outer VM gets host paths on its kernel command line, \
                         so they must be UTF-8 without spaces or commas",
                        p.display()
                    ),
                ));
            }
        }
        let keep: Vec<String> = keep.iter().map(|p| p.display().to_string()).collect();
        let append = format!(
            "console=ttyS0 loglevel=4 mitigations=off l1.work={} l1.keep={} l1.cmd={}",
            work.display(),
            keep.join(","),
            script.display()
        );
        let mut cmd = Command::new(&opts.qemu);
        cmd.args([
            "-accel",
            &format!("tcg,thread={},tb-size=512", opts.tcg_thread),
            "-cpu",
            &opts.cpu,
            "-smp",
            &opts.smp.to_string(),
            "-m",
            &opts.mem_mib.to_string(),
            "-M",
            "q35",
            "-nographic",
            "-no-reboot",
            "-monitor",
            "none",
            "-serial",
            "stdio",
            "-kernel",
        ])
        .arg(kernel)
        .arg("-initrd")
        .arg(initrd)
        .arg("-append")
        .arg(append)
        .arg("-virtfs")
        .arg("local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap")
        .arg("-virtfs")
        .arg(format!(
            "local,path={},mount_tag=work,security_model=none",
            work.display()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        // SAFETY: prctl(PR_SET_PDEATHSIG) in the forked child only sets a
        // process attribute; it allocates nothing and touches no locks.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        let (tx, rx) = mpsc::channel();
        let mut file = std::fs::File::create(log)?;
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let tx2 = tx.clone();
        if let Some(err) = stderr {
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    if tx2.send(format!("qemu: {line}")).is_err() {
                        break;
                    }
                }
            });
        }
        if let Some(out) = stdout {
            std::thread::spawn(move || {
                let mut reader = BufReader::new(out);
                let mut buf = Vec::new();
                loop {
                    buf.clear();
                    match reader.read_until(b'\n', &mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {
                            let _ = file.write_all(&buf);
                            let line = String::from_utf8_lossy(&buf)
                                .trim_end_matches(['\r', '\n'])
                                .to_string();
                            if tx.send(line).is_err() {
                                break;
                            }
                        }
                    }
                }
                let _ = file.flush();
            });
        }
        Ok(L1 { child, lines: rx })
    }

    /// QEMU's exit status, once it has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Kills QEMU and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for L1 {
    fn drop(&mut self) {
        if self.exited().is_none() {
            self.kill();
        }
    }
}
