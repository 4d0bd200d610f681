//! `hostagent.v1.Sessions`.

use std::sync::Arc;

use proto::hostagent as pb;
use proto::hostagent::sessions_server::Sessions;
use tonic::{Request, Response, Status};

use super::listing::{check_labels, list_page};
use super::{check_key, idempotent, owned_session};
use crate::auth::layer::caller_of;
use crate::auth::Caller;
use crate::error::{Error, Result};
use crate::images::valid_id;
use crate::path_roots::Kind;
use crate::session_env::SessionEnv;
use crate::sessions::{reason, CreateParams, Manager};

/// Longest TTL or idle timeout accepted: 30 days.
const MAX_LIMIT_S: u64 = 30 * 24 * 3600;

/// The Sessions service.
pub struct SessionsApi(pub Arc<Manager>);

impl SessionsApi {
    /// One call on one session: checks the id and that the caller may see
    /// the session, then runs `op` unless the idempotency key already holds
    /// an answer for it.
    async fn on_session<T, F, Fut>(
        &self,
        req: Request<pb::SessionCall>,
        method: &str,
        op: F,
    ) -> Result<Response<T>, Status>
    where
        T: prost::Message + Default,
        F: FnOnce(Arc<Manager>, String) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let caller = caller_of(&req)?;
        let call = req.into_inner();
        owned_session(&self.0, &caller, &call.session_id)?;
        let work = op(self.0.clone(), call.session_id.clone());
        let answer = idempotent(
            &self.0,
            &caller,
            &call.idempotency_key,
            method,
            &call.session_id,
            work,
        )
        .await?;
        Ok(Response::new(answer))
    }
}

/// CreateSession's request checked and resolved for `caller` (also how a
/// schedule's session template is checked).
pub(crate) fn create_params(
    mgr: &Manager,
    caller: &Caller,
    r: pb::CreateSessionRequest,
) -> Result<CreateParams> {
    valid_id(&r.image_id)?;
    check_key(&r.idempotency_key)?;
    let limits = r.limits.unwrap_or_default();
    for (name, v) in [
        ("limits.ttl_seconds", limits.ttl_seconds),
        ("limits.idle_timeout_seconds", limits.idle_timeout_seconds),
    ] {
        if v > MAX_LIMIT_S {
            return Err(Error::invalid(format!(
                "{name} {v} is out of range 0..={MAX_LIMIT_S}"
            )));
        }
    }
    let labels = check_labels("labels", &r.labels)?;
    for (name, v) in [
        ("repository_path", &r.repository_path),
        ("agent", &r.agent),
        ("base_ref", &r.base_ref),
    ] {
        if v.len() > 4096 {
            return Err(Error::invalid(format!("{name} is longer than 4096 bytes")));
        }
    }
    // A session of an image made from a session becomes a fork of that
    // session in the guest (ForkSession): it keeps the source's repository,
    // agent, environment, secrets and size, so asking for others is an
    // error, never silently dropped.
    if let Some(image) = mgr
        .store
        .image(&r.image_id)?
        .filter(|i| !i.source_session.is_empty())
    {
        let sized = r
            .resources
            .as_ref()
            .is_some_and(|x| *x != pb::SessionResources::default());
        let given: Vec<&str> = [
            ("repository_path", !r.repository_path.is_empty()),
            ("agent", !r.agent.is_empty()),
            ("base_ref", !r.base_ref.is_empty()),
            ("env", !r.env.is_empty()),
            ("secrets", !r.secrets.is_empty()),
            ("secret_refs", !r.secret_refs.is_empty()),
            ("resources", sized),
            ("shares", !r.shares.is_empty()),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect();
        if !given.is_empty() {
            return Err(Error::invalid(format!(
                "{}: image {:?} was made from session {}, and its sessions start as forks of \
                 it, with its repository, agent, environment, secrets, size and shares; leave \
                 these empty",
                given.join(", "),
                image.id,
                image.source_session
            )));
        }
    }
    // Environment and secrets go to guest-init; an image without it has
    // nothing to give them to.
    if !(r.env.is_empty() && r.secrets.is_empty() && r.secret_refs.is_empty()) {
        if let Some(image) = mgr.store.image(&r.image_id)?.filter(|i| !i.guest_init) {
            return Err(Error::invalid(format!(
                "env, secrets, secret_refs: image {:?} runs no guest-init, so nothing in \
                 its VMs would receive them",
                image.id
            )));
        }
    }
    let session_env = SessionEnv::from_request(
        r.env,
        r.secrets,
        r.secret_refs,
        mgr.cfg.secrets_dir.as_deref(),
    )?;
    // Shares: their form, then their directories under the share roots
    // (merged with the image's at create).
    let mut shares = crate::shares::check_request("shares", &r.shares)?;
    crate::shares::resolve(mgr.share_roots.as_ref(), "shares", &mut shares)?;
    // The repository is used as it resolves now, and only under the roots.
    let repository = if r.repository_path.is_empty() {
        String::new()
    } else {
        mgr.repository_roots
            .check("repository_path", &r.repository_path, Kind::Dir)?
            .display()
            .to_string()
    };
    Ok(CreateParams {
        image_id: r.image_id,
        idempotency_key: caller.scoped_key(&r.idempotency_key),
        ttl_s: limits.ttl_seconds,
        idle_s: limits.idle_timeout_seconds,
        labels,
        repository,
        agent: r.agent,
        base_ref: r.base_ref,
        owner: caller.name.clone(),
        io_limits: crate::io_limits::IoLimits::from_pb(r.io_limits.as_ref())?,
        may_loosen_limits: caller.may(crate::auth::Scope::Admin),
        session_env_digest: session_env.fingerprint(&mgr.fingerprint_key),
        session_env: Arc::new(session_env),
        resources: r.resources,
        auto_resume: r.auto_resume,
        shares,
    })
}

#[tonic::async_trait]
impl Sessions for SessionsApi {
    async fn create_session(
        &self,
        req: Request<pb::CreateSessionRequest>,
    ) -> Result<Response<pb::Session>, Status> {
        let caller = caller_of(&req)?;
        let p = create_params(&self.0, &caller, req.into_inner())?;
        let row = self.0.create(p).await?;
        Ok(Response::new(self.0.session_out(&row)))
    }

    async fn get_session(
        &self,
        req: Request<pb::SessionRef>,
    ) -> Result<Response<pb::Session>, Status> {
        let caller = caller_of(&req)?;
        let id = req.into_inner().session_id;
        let sess = owned_session(&self.0, &caller, &id)?;
        let mut out = self.0.session_out(&sess.row());
        out.network = network_pb(&self.0, &id);
        Ok(Response::new(out))
    }

    async fn list_sessions(
        &self,
        req: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let caller = caller_of(&req)?;
        let page = list_page(&self.0.store, &caller, req.into_inner(), |row| {
            let mut out = self.0.session_out(row);
            out.network = network_pb(&self.0, &row.id);
            out
        })?;
        Ok(Response::new(page))
    }

    async fn pause_session(
        &self,
        req: Request<pb::PauseSessionRequest>,
    ) -> Result<Response<pb::Session>, Status> {
        let (meta, ext, r) = req.into_parts();
        let persist = r.persist;
        let call = Request::from_parts(
            meta,
            ext,
            pb::SessionCall {
                session_id: r.session_id,
                idempotency_key: r.idempotency_key,
            },
        );
        let method = if persist {
            "PauseSession(persist)"
        } else {
            "PauseSession"
        };
        self.on_session(call, method, |mgr, id| async move {
            let row = if persist {
                mgr.persist(&id, reason::REQUESTED).await?
            } else {
                mgr.pause(&id, reason::REQUESTED).await?
            };
            Ok(mgr.session_out(&row))
        })
        .await
    }

    async fn fork_session(
        &self,
        req: Request<pb::ForkSessionRequest>,
    ) -> Result<Response<pb::ForkSessionResponse>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        check_key(&r.idempotency_key)?;
        owned_session(&self.0, &caller, &r.session_id)?;
        let labels = if r.labels.is_empty() {
            None
        } else {
            Some(check_labels("labels", &r.labels)?)
        };
        let fp = format!("{:?}", (&r.session_id, r.count, &labels));
        let mgr = self.0.clone();
        let work = async {
            let (source, made) = mgr
                .fork(&r.session_id, r.count, labels, &caller.name)
                .await?;
            Ok(pb::ForkSessionResponse {
                source: Some(mgr.session_out(&source)),
                sessions: made.iter().map(|s| mgr.session_out(s)).collect(),
            })
        };
        let answer = idempotent(
            &self.0,
            &caller,
            &r.idempotency_key,
            "ForkSession",
            &fp,
            work,
        )
        .await?;
        Ok(Response::new(answer))
    }

    async fn resume_session(
        &self,
        req: Request<pb::SessionCall>,
    ) -> Result<Response<pb::Session>, Status> {
        // A session this node does not know may have been moved here
        // (MoveSession on another node): taken in first, then resumed.
        let id = &req.get_ref().session_id;
        if let (Some(fleet), Err(_)) = (self.0.fleet.get(), self.0.session(id)) {
            let caller = caller_of(&req)?;
            self.0.move_in(fleet, &caller, id).await?;
        }
        self.on_session(req, "ResumeSession", |mgr, id| async move {
            Ok(mgr.session_out(&mgr.resume(&id).await?))
        })
        .await
    }

    async fn snapshot_session(
        &self,
        req: Request<pb::SessionCall>,
    ) -> Result<Response<pb::SnapshotSessionResponse>, Status> {
        self.on_session(req, "SnapshotSession", |mgr, id| async move {
            let (row, dir, pages) = mgr.snapshot(&id).await?;
            Ok(pb::SnapshotSessionResponse {
                session: Some(mgr.session_out(&row)),
                snapshot_dir: dir,
                pages_written: pages,
            })
        })
        .await
    }

    async fn restore_session(
        &self,
        req: Request<pb::RestoreSessionRequest>,
    ) -> Result<Response<pb::Session>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        owned_session(&self.0, &caller, &r.session_id)?;
        let mgr = &self.0;
        let s = idempotent(
            mgr,
            &caller,
            &r.idempotency_key,
            "RestoreSession",
            &format!("{}\0{}", r.session_id, r.snapshot_dir),
            async {
                let row = mgr.restore_session(&r.session_id, &r.snapshot_dir).await?;
                Ok(mgr.session_out(&row))
            },
        )
        .await?;
        Ok(Response::new(s))
    }

    async fn update_session_network(
        &self,
        req: Request<pb::UpdateSessionNetworkRequest>,
    ) -> Result<Response<pb::SessionNetwork>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        owned_session(&self.0, &caller, &r.session_id)?;
        let state = self
            .0
            .update_network(
                &r.session_id,
                &r.allow,
                &r.deny,
                caller.may(crate::auth::Scope::Admin),
            )
            .await?;
        Ok(Response::new(state_pb(&r.session_id, state)))
    }

    async fn expose_port(
        &self,
        req: Request<pb::ExposePortRequest>,
    ) -> Result<Response<pb::ExposedPort>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        owned_session(&self.0, &caller, &r.session_id)?;
        let e = self
            .0
            .expose_port(&r.session_id, r.guest_port, &r.protocol)
            .await?;
        Ok(Response::new(exposed_pb(&e)))
    }

    async fn unexpose_port(
        &self,
        req: Request<pb::ExposePortRequest>,
    ) -> Result<Response<pb::SessionNetwork>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        owned_session(&self.0, &caller, &r.session_id)?;
        let state = self.0.unexpose_port(&r.session_id, r.guest_port).await?;
        Ok(Response::new(state_pb(&r.session_id, state)))
    }

    async fn stop_session(
        &self,
        req: Request<pb::SessionCall>,
    ) -> Result<Response<pb::Session>, Status> {
        self.on_session(req, "StopSession", |mgr, id| async move {
            Ok(mgr.session_out(&mgr.stop(&id, reason::REQUESTED).await?))
        })
        .await
    }

    async fn delete_session(
        &self,
        req: Request<pb::SessionCall>,
    ) -> Result<Response<pb::DeleteSessionResponse>, Status> {
        self.on_session(req, "DeleteSession", |mgr, id| async move {
            mgr.delete(&id).await?;
            Ok(pb::DeleteSessionResponse {})
        })
        .await
    }
}

/// A session's network as the API reports it.
fn state_pb(id: &str, s: crate::sessions::NetworkState) -> pb::SessionNetwork {
    pb::SessionNetwork {
        session_id: id.to_string(),
        allow: s.allow,
        deny: s.deny,
        vm_address: s.vm_address,
        vm_address6: s.vm_address6.unwrap_or_default(),
        hosts: s.hosts,
        exposed_ports: s.exposed.iter().map(exposed_pb).collect(),
    }
}

fn exposed_pb(e: &crate::sessions::Exposed) -> pb::ExposedPort {
    pb::ExposedPort {
        guest_port: e.guest_port.into(),
        protocol: "tcp".into(),
        host_address: e.host.clone(),
    }
}

/// Session `id`'s network, when it has one.
fn network_pb(mgr: &crate::sessions::Manager, id: &str) -> Option<pb::SessionNetwork> {
    mgr.network_state(id)
        .ok()
        .flatten()
        .map(|s| state_pb(id, s))
}
