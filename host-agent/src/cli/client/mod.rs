//! The operator client: the `images`, `sessions`, `events`, `usage`,
//! `node`, `exec`, `turns`, `approvals`, `audit`, `files`, `snapshots`,
//! `schedules`, `triggers` and `fleet` subcommands over the gRPC API.

use std::path::PathBuf;

use tonic::transport::Channel;

use super::output::Output;
use crate::Cmd;

mod approvals;
mod events;
mod exec;
mod files;
mod fleet;
mod images;
mod io_limits;
mod labels;
mod node;
mod schedules;
mod session_env;
mod sessions;
mod shares;
mod snapshots;
mod triggers;
mod turns;
mod usage;

pub use approvals::ApprovalsCmd;
pub use events::EventsCmd;
pub use exec::ExecArgs;
pub use files::FilesCmd;
pub use fleet::FleetCmd;
pub use images::ImagesCmd;
pub use schedules::SchedulesCmd;
pub use sessions::SessionsCmd;
pub use snapshots::SnapshotsCmd;
pub use triggers::TriggersCmd;
pub use turns::TurnsCmd;

/// Client TLS settings from the global flags.
pub struct ClientTls {
    /// CA of the server certificate.
    pub ca: Option<PathBuf>,
    /// This client's certificate.
    pub cert: Option<PathBuf>,
    /// This client's key.
    pub key: Option<PathBuf>,
    /// Server name to verify.
    pub domain: Option<String>,
}

/// Adds `authorization: Bearer <token>` to every call when a token is set.
#[derive(Clone)]
pub struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl Bearer {
    /// Reads the token from `path` (none without a path).
    fn from_file(path: Option<&PathBuf>) -> Result<Bearer, String> {
        let Some(p) = path else {
            return Ok(Bearer(None));
        };
        let text = std::fs::read_to_string(p)
            .map_err(|e| format!("reading token file {}: {e}", p.display()))?;
        let token = text.trim();
        if token.is_empty() {
            return Err(format!("token file {} is empty", p.display()));
        }
        // The token itself never goes into a message.
        let v = format!("Bearer {token}").parse().map_err(|_| {
            format!(
                "token file {} holds characters a header cannot carry",
                p.display()
            )
        })?;
        Ok(Bearer(Some(v)))
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

pub async fn run_client(
    addr: String,
    tls: ClientTls,
    token_file: Option<PathBuf>,
    out: Output,
    cmd: Cmd,
) -> Result<(), String> {
    let bearer = Bearer::from_file(token_file.as_ref())?;
    let mut client_tls = None;
    if tls.ca.is_some() || tls.cert.is_some() {
        let read = |p: &PathBuf| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        let mut t = tonic::transport::ClientTlsConfig::new();
        if let Some(ca) = &tls.ca {
            t = t.ca_certificate(tonic::transport::Certificate::from_pem(read(ca)?));
        }
        if let (Some(c), Some(k)) = (&tls.cert, &tls.key) {
            t = t.identity(tonic::transport::Identity::from_pem(read(c)?, read(k)?));
        }
        if let Some(d) = tls.domain {
            t = t.domain_name(d);
        }
        client_tls = Some(t);
    }
    let ch: Channel = host_agent::connect(&addr, client_tls).await?;
    match cmd {
        // Invariant: main() runs Serve and Demo itself and never passes them here.
        Cmd::Serve(_) | Cmd::Demo(_) => unreachable!("handled in main"),
        Cmd::Images(c) => images::run(ch, bearer, out, c).await,
        Cmd::Sessions(c) => sessions::run(ch, bearer, out, c).await,
        Cmd::Events(c) => events::run(ch, bearer, out, c).await,
        Cmd::Usage { session, since } => usage::run(ch, bearer, out, session, since).await,
        Cmd::Exec(args) => exec::run(ch, bearer, out, args).await,
        Cmd::Node => node::run(ch, bearer, out).await,
        Cmd::Turns(c) => turns::run(ch, bearer, out, c).await,
        Cmd::Approvals(c) => approvals::run(ch, bearer, out, c).await,
        Cmd::Files(c) => files::run(ch, bearer, out, c).await,
        Cmd::Audit { session, verify } => approvals::audit(ch, bearer, out, session, verify).await,
        Cmd::Snapshots(c) => snapshots::run(ch, bearer, out, c).await,
        Cmd::Schedules(c) => schedules::run(ch, bearer, out, c).await,
        Cmd::Triggers(c) => triggers::run(ch, bearer, out, c).await,
        Cmd::Fleet(c) => fleet::run(ch, bearer, out, c).await,
    }
}

/// `execution_id`, or, when not given, session `session`'s current one.
async fn execution_id_or_current(
    ch: &Channel,
    bearer: &Bearer,
    session: &str,
    execution_id: Option<String>,
) -> Result<String, String> {
    if let Some(e) = execution_id {
        return Ok(e);
    }
    Ok(
        proto::hostagent::sessions_client::SessionsClient::with_interceptor(
            ch.clone(),
            bearer.clone(),
        )
        .get_session(proto::hostagent::SessionRef {
            session_id: session.to_string(),
        })
        .await
        .map_err(status)?
        .into_inner()
        .execution_id,
    )
}

/// A gRPC status as the client prints it.
fn status(e: tonic::Status) -> String {
    format!("{:?}: {}", e.code(), e.message())
}
