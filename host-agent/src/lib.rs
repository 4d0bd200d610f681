//! host-agent: the per-node daemon that control planes call over gRPC.
//!
//! It supervises one `vmm` process per session (restored from an image's
//! golden snapshot or taken from a warm pool), records every lifecycle
//! transition as an event with a per-node seq, samples usage every second,
//! and keeps all of it in SQLite so that a restart re-attaches to running
//! VMs and loses nothing.
//!
//! Modules follow the data flow: [`api`] (one module per gRPC service) →
//! [`sessions`] (state machine) → [`supervisor`] (vmm processes), with
//! [`pool`], [`accounting`], [`events`], [`store`], [`images`], [`metrics`]
//! and [`config`] beside them.

#![warn(missing_docs)]

pub mod accounting;
pub mod api;
pub mod auth;
pub mod clock;
pub mod config;
pub mod error;
pub mod events;
pub mod execs;
pub mod fleet;
pub mod guest;
pub mod images;
pub mod io_limits;
pub mod jail_uids;
pub mod launch;
pub mod layers;
pub mod metrics;
pub mod network;
pub mod path_roots;
pub mod pool;
pub mod repo;
pub mod safe_fs;
pub mod schedules;
pub mod session_env;
pub mod sessions;
pub mod shares;
pub mod store;
pub mod supervisor;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use proto::hostagent::{
    approvals_server::ApprovalsServer, events_server::EventsServer, exec_server::ExecServer,
    images_server::ImagesServer, node_server::NodeServer, schedules_server::SchedulesServer,
    sessions_server::SessionsServer, snapshots_server::SnapshotsServer, usage_server::UsageServer,
};
use tokio::net::TcpListener;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::sessions::Manager;

/// Where the gRPC server accepts connections.
pub enum Listener {
    /// A TCP listener (loopback, or anything with mutual TLS).
    Tcp(TcpListener),
    /// A Unix socket listener.
    Unix(tokio::net::UnixListener),
}

/// Runs host-agent on `listener` until `shutdown` completes.
pub async fn serve(
    cfg: Config,
    listener: Listener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    cfg.validate()?;
    let clients = match &cfg.clients_file {
        Some(p) => auth::clients::Clients::load(p)?,
        None => auth::clients::Clients::default(),
    };
    if cfg.clients_file.is_none() && cfg.unauthenticated_local.is_none() {
        tracing::warn!(
            "no clients_file and no unauthenticated_local: every call except the health check \
             will be refused (UNAUTHENTICATED)"
        );
    }
    let authenticator = Arc::new(auth::layer::Authenticator {
        clients,
        unauthenticated_local: cfg.unauthenticated_local,
    });
    let mgr = Manager::new(cfg.clone())?;
    mgr.recover().await?;
    let address = match &listener {
        Listener::Tcp(l) => l
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| cfg.listen.to_string()),
        Listener::Unix(_) => cfg
            .listen_unix
            .as_ref()
            .map(|p| format!("unix:{}", p.display()))
            .unwrap_or_default(),
    };
    let fleet = fleet::Fleet::start(&mgr, cfg.fleet.clone(), address).await?;
    // Set once, here, before any call is served.
    let _ = mgr.fleet.set(fleet.clone());

    let m = mgr.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(m.cfg.usage_interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            m.sample_usage();
        }
    });
    let m = mgr.clone();
    tokio::spawn(async move {
        // The network counters, as often as usage records are written; the
        // namespaces' `denied` counters (a process per read) every tenth time.
        let mut tick = tokio::time::interval(Duration::from_millis(m.cfg.usage_interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for n in 0u64.. {
            tick.tick().await;
            m.sample_network(n % 10 == 0).await;
        }
    });
    let m = mgr.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(m.cfg.limits_interval_ms));
        loop {
            tick.tick().await;
            m.enforce_limits();
        }
    });
    if cfg.warm_pool_size > 0 {
        tokio::spawn(mgr.clone().run_pool(cfg.warm_pool_size as usize));
    }
    let scheduler = schedules::Scheduler::start(
        mgr.clone(),
        Duration::from_secs(cfg.schedule_retry_window_seconds),
    )?;
    let (webhook_stop, webhook_stopped) = tokio::sync::oneshot::channel::<()>();
    if let Some(addr) = cfg.webhook_listen {
        let l = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::io(format!("binding webhook address {addr}"), e))?;
        tracing::info!(%addr, "webhook listener for triggers");
        let sched = scheduler.clone();
        tokio::spawn(async move {
            let stopped = async move {
                let _ = webhook_stopped.await;
            };
            if let Err(e) = schedules::webhook::serve(sched, l, stopped).await {
                tracing::error!(error = %e, "webhook listener");
            }
        });
    }
    if let Some(addr) = cfg.metrics_listen {
        let l = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::io(format!("binding metrics address {addr}"), e))?;
        tokio::spawn(metrics::serve(l, mgr.clone()));
    }

    let (health, health_svc) = tonic_health::server::health_reporter();
    health
        .set_serving::<ImagesServer<api::images::ImagesApi>>()
        .await;
    health
        .set_serving::<SessionsServer<api::sessions::SessionsApi>>()
        .await;
    health.set_serving::<ExecServer<api::exec::ExecApi>>().await;
    health
        .set_serving::<ApprovalsServer<api::approvals::ApprovalsApi>>()
        .await;
    health
        .set_serving::<proto::hostagent::files_server::FilesServer<api::files::FilesApi>>()
        .await;
    health
        .set_serving::<EventsServer<api::events::EventsApi>>()
        .await;
    health
        .set_serving::<UsageServer<api::usage::UsageApi>>()
        .await;
    health.set_serving::<NodeServer<api::node::NodeApi>>().await;
    health
        .set_serving::<proto::hostagent::fleet_server::FleetServer<api::fleet::FleetApi>>()
        .await;
    health
        .set_serving::<SnapshotsServer<api::snapshots::SnapshotsApi>>()
        .await;
    health
        .set_serving::<SchedulesServer<api::schedules::SchedulesApi>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::hostagent::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| Error::invalid(format!("reflection: {e}")))?;

    let mut builder = tonic::transport::Server::builder();
    if let Some(t) = &cfg.tls {
        let read = |p: &std::path::Path| {
            std::fs::read(p).map_err(|e| Error::io(format!("reading {}", p.display()), e))
        };
        let tls = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(
                read(&t.cert)?,
                read(&t.key)?,
            ))
            .client_ca_root(tonic::transport::Certificate::from_pem(read(&t.ca)?))
            .client_auth_optional(false);
        builder = builder
            .tls_config(tls)
            .map_err(|e| Error::invalid(format!("TLS configuration: {e}")))?;
    }
    let router = builder
        .layer(auth::layer::AuthLayer(authenticator))
        .add_service(health_svc)
        .add_service(reflection)
        .add_service(ImagesServer::new(api::images::ImagesApi(mgr.clone())))
        .add_service(SessionsServer::new(api::sessions::SessionsApi(mgr.clone())))
        .add_service(ExecServer::new(api::exec::ExecApi(mgr.clone())))
        .add_service(ApprovalsServer::new(api::approvals::ApprovalsApi(
            mgr.clone(),
        )))
        .add_service(proto::hostagent::files_server::FilesServer::new(
            api::files::FilesApi(mgr.clone()),
        ))
        .add_service(EventsServer::new(api::events::EventsApi(mgr.clone())))
        .add_service(UsageServer::new(api::usage::UsageApi(mgr.clone())))
        .add_service(NodeServer::new(api::node::NodeApi(mgr.clone())))
        .add_service(proto::hostagent::fleet_server::FleetServer::new(
            api::fleet::FleetApi(mgr.clone()),
        ))
        .add_service(SnapshotsServer::new(api::snapshots::SnapshotsApi(
            mgr.clone(),
        )))
        .add_service(SchedulesServer::new(api::schedules::SchedulesApi {
            mgr: mgr.clone(),
            sched: scheduler.clone(),
        }));
    let result = match listener {
        Listener::Tcp(l) => {
            let incoming = nodelay_incoming(l);
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
        Listener::Unix(l) => {
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(l);
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
    };
    let _ = webhook_stop.send(());
    fleet.leave().await;
    if mgr.cfg.stop_sessions_on_shutdown {
        mgr.stop_all().await;
    }
    mgr.pool.drain_all();
    // Warm VMs still being restored are not in the pool yet: kill them by
    // their pid files.
    pool::Pool::clean_leftovers(&mgr.pool_dir());
    result.map_err(|e| Error::io("gRPC server", std::io::Error::other(e)))
}

/// Waits for SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers, run until killed.
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
}

/// Connects a gRPC channel to `addr`: `http://HOST:PORT`, `https://...`, or
/// `unix:PATH` for a Unix socket.
pub async fn connect(
    addr: &str,
    tls: Option<tonic::transport::ClientTlsConfig>,
) -> std::result::Result<tonic::transport::Channel, String> {
    if let Some(path) = addr.strip_prefix("unix:") {
        let path = std::path::PathBuf::from(path);
        // The URI is required by the API but unused by the connector.
        let ep = tonic::transport::Endpoint::from_static("http://localhost");
        return ep
            .connect_with_connector(tower::service_fn(move |_| {
                let path = path.clone();
                async move {
                    let s = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
                }
            }))
            .await
            .map_err(|e| format!("cannot connect to {addr}: {e}"));
    }
    let mut ep = tonic::transport::Channel::from_shared(addr.to_string())
        .map_err(|e| format!("bad address {addr:?}: {e}"))?;
    if let Some(t) = tls {
        ep = ep.tls_config(t).map_err(|e| format!("TLS: {e}"))?;
    }
    ep.connect()
        .await
        .map_err(|e| format!("cannot connect to {addr}: {e}"))
}

/// The connections `listener` accepts, with TCP_NODELAY set: gRPC answers
/// are small writes, and without it a burst of calls on one HTTP/2
/// connection (a control plane creating 4 sessions at once) had every answer
/// but the first wait about 40 ms for the client's delayed ACK (Nagle's
/// algorithm), measured with `perf session-create`.
fn nodelay_incoming(
    listener: TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(listener).map(|conn| {
        conn.inspect(|stream| {
            if let Err(e) = stream.set_nodelay(true) {
                tracing::debug!(error = %e, "cannot set TCP_NODELAY on a gRPC connection");
            }
        })
    })
}

#[cfg(test)]
mod nodelay_tests {
    use super::*;

    #[tokio::test]
    async fn grpc_connections_are_accepted_with_nodelay() {
        use tokio_stream::StreamExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = Box::pin(nodelay_incoming(listener));
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(accepted.nodelay().unwrap());
    }
}
