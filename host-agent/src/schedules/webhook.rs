//! The webhook listener (`--webhook-listen`): `POST /triggers/<id>` only,
//! plain HTTP/1.1 (put a TLS proxy in front where the network is not
//! trusted; the HMAC signature authenticates each request either way).
//! Answers are JSON: `{"run_id": N, "state": "PENDING"}` with 202, or
//! `{"error": "...", "outcome": "..."}` with the refusal's status.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::{to_bytes, Body};
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};

use super::triggers::{
    Headers, Refusal, DELIVERY_HEADER, MAX_BODY_BYTES, SIGNATURE_HEADER, TIMESTAMP_HEADER,
};
use super::Scheduler;
use crate::error::{Error, Result};

fn header(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

async fn trigger(
    State(sched): State<Arc<Scheduler>>,
    Path(id): Path<String>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let h = Headers {
        timestamp: header(&headers, TIMESTAMP_HEADER),
        delivery: header(&headers, DELIVERY_HEADER),
        signature: header(&headers, SIGNATURE_HEADER),
    };
    let body = to_bytes(body, MAX_BODY_BYTES)
        .await
        .map(|b| b.to_vec())
        .map_err(|_| Refusal {
            status: 413,
            outcome: "too_large",
            detail: format!("the body is over {MAX_BODY_BYTES} bytes (or was cut off)"),
        });
    // Recording touches SQLite: off the async workers.
    let remote = peer.to_string();
    let done = tokio::task::spawn_blocking(move || sched.deliver(&id, &h, body, &remote)).await;
    match done {
        Ok(Ok(run)) => {
            let state = super::run_state_name(run.state);
            (
                StatusCode::ACCEPTED,
                Json(serde_json::json!({ "run_id": run.id, "state": state })),
            )
                .into_response()
        }
        Ok(Err(r)) => (
            StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST),
            Json(serde_json::json!({ "error": r.detail, "outcome": r.outcome })),
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(serde_json::json!({ "error": format!("the delivery's task failed: {e}") })),
        )
            .into_response(),
    }
}

/// Serves the webhook listener on `listener` until `shutdown` resolves.
pub async fn serve(
    sched: Arc<Scheduler>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let app = Router::new()
        .route("/triggers/{id}", post(trigger))
        .with_state(sched);
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
    .map_err(|e| Error::Schedule(format!("the webhook listener failed: {e}")))
}
