//! A host-agent process in the outer VM for the `node` scenarios: started
//! on the group's scratch state with a generous guest-ready timeout, one log
//! per start, a gRPC channel and a runtime to drive it, stopped on drop.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tonic::transport::Channel;

use crate::inner::Ctx;

/// The `secrets_dir` host-agent is started with (`node-secrets` fills it).
pub fn secrets_dir(ctx: &Ctx) -> std::path::PathBuf {
    ctx.scratch.join("secrets")
}

/// The fleet node name of the group's host-agent, and of the second one
/// `node-move` starts.
pub const NODE_A: &str = "node-a";
/// The second node's name.
pub const NODE_B: &str = "node-b";

/// The directory of the image store every node shares (`node-move`).
pub fn image_store_dir(ctx: &Ctx) -> std::path::PathBuf {
    ctx.scratch.join("image-store")
}

/// That store as host-agent's `image_store` URL.
pub fn image_store(ctx: &Ctx) -> String {
    format!("file://{}", image_store_dir(ctx).display())
}

/// A host-agent process in the outer VM, stopped (sessions with it) on drop.
pub struct HostAgent {
    child: Child,
    addr: String,
    rt: tokio::runtime::Runtime,
}

impl HostAgent {
    /// Starts host-agent with `warm_pool` warm VMs and no network.
    pub fn start(ctx: &Ctx, warm_pool: u32) -> Result<HostAgent, String> {
        Self::start_with(ctx, warm_pool, None)
    }

    /// Starts host-agent with `warm_pool` warm VMs and, when given, these
    /// `network` settings (host-agent's JSON configuration).
    pub fn start_with(
        ctx: &Ctx,
        warm_pool: u32,
        network: Option<serde_json::Value>,
    ) -> Result<HostAgent, String> {
        Self::start_as(ctx, NODE_A, warm_pool, network)
    }

    /// Starts fleet node `node` (state `host-agent` for [`NODE_A`],
    /// `host-agent-<node>` otherwise), every node with the group's
    /// [`image_store`].
    pub fn start_as(
        ctx: &Ctx,
        node: &str,
        warm_pool: u32,
        network: Option<serde_json::Value>,
    ) -> Result<HostAgent, String> {
        let state = if node == NODE_A {
            ctx.scratch.join("host-agent")
        } else {
            ctx.scratch.join(format!("host-agent-{node}"))
        };
        std::fs::create_dir_all(&state).map_err(|e| e.to_string())?;
        // A real guest booting under nested emulation takes far longer
        // than on hardware to answer: wait for it generously. The scenarios
        // call over loopback without credentials (as the local admin), with
        // the node image's files and the scratch repository as the only
        // host paths requests may name.
        // A file's directory, and its target's where it is a link.
        let img = ctx.env.node_image()?;
        let image_roots: Vec<std::path::PathBuf> =
            [Some(&img.kernel), img.initrd.as_ref(), Some(&img.rootfs)]
                .into_iter()
                .flatten()
                .flat_map(|p| [Some(p.clone()), std::fs::canonicalize(p).ok()])
                .flatten()
                .filter_map(|p| p.parent().map(|d| d.to_path_buf()))
                .collect();
        let config = ctx.scratch.join(format!("host-agent-{node}.json"));
        let secrets = secrets_dir(ctx);
        std::fs::create_dir_all(&secrets).map_err(|e| e.to_string())?;
        let mut settings = serde_json::json!({
            "guest_ready_timeout_seconds": 900,
            "unauthenticated_local": "admin",
            "allowed_image_roots": image_roots,
            "allowed_repository_roots": [ctx.scratch],
            "secrets_dir": secrets,
            "fleet": {"node_name": node, "image_store": image_store(ctx)},
        });
        if let Some(network) = network {
            settings["network"] = network;
        }
        std::fs::write(&config, settings.to_string()).map_err(|e| e.to_string())?;
        // One log per start (pool-timing restarts it on the same state;
        // node-move starts a second node).
        let starts = std::fs::read_dir(&ctx.scratch)
            .map(|d| {
                d.flatten()
                    .filter(|e| {
                        let n = e.file_name().to_string_lossy().into_owned();
                        n.starts_with("host-agent-") && n.ends_with(".log")
                    })
                    .count()
            })
            .unwrap_or(0);
        let log_name = format!("host-agent-{}.log", starts + 1);
        let log = std::fs::File::create(ctx.scratch.join(&log_name)).map_err(|e| e.to_string())?;
        let mut child = Command::new(&ctx.env.host_agent)
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--state-dir")
            .arg(&state)
            .arg("--vmm")
            .arg(&ctx.env.vmm)
            .arg("--warm-pool")
            .arg(warm_pool.to_string())
            .arg("--stop-sessions-on-shutdown")
            .env("RUST_LOG", "host_agent=debug,info")
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting host-agent: {e}"))?;
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            BufReader::new(out)
                .read_line(&mut line)
                .map_err(|e| format!("reading host-agent's first line: {e}"))?;
        }
        let addr = line
            .trim()
            .strip_prefix("host-agent listening on ")
            .ok_or_else(|| format!("host-agent said {line:?} (log: {log_name})"))?
            .to_string();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        Ok(HostAgent {
            child,
            addr: format!("http://{addr}"),
            rt,
        })
    }

    pub fn channel(&self) -> Result<Channel, String> {
        let addr = self.addr.clone();
        self.rt.block_on(async move {
            Channel::from_shared(addr)
                .map_err(|e| e.to_string())?
                .connect()
                .await
                .map_err(|e| format!("connecting to host-agent: {e}"))
        })
    }

    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    pub fn stop(&mut self) {
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for HostAgent {
    fn drop(&mut self) {
        self.stop();
    }
}
