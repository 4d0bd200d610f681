//! Prometheus metrics in text format, served over plain HTTP on loopback.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

static API_ERRORS: Mutex<Vec<(i32, u64)>> = Mutex::new(Vec::new());
static GUEST_DROPPED: Mutex<Vec<(&'static str, u64)>> = Mutex::new(Vec::new());
/// Restore latency histogram bucket bounds, seconds.
const BUCKETS: [f64; 10] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];
static RESTORE_BUCKETS: [AtomicU64; 11] = [const { AtomicU64::new(0) }; 11];
static RESTORE_SUM_US: AtomicU64 = AtomicU64::new(0);
static RESTORE_COUNT: AtomicU64 = AtomicU64::new(0);
static WARM_FALLBACKS: AtomicU64 = AtomicU64::new(0);
static RESTORE_RETRIES: AtomicU64 = AtomicU64::new(0);

/// Counts an API error by gRPC code.
pub fn api_error(code: tonic::Code) {
    let mut v = API_ERRORS.lock().unwrap_or_else(|p| p.into_inner());
    let c = code as i32;
    match v.iter_mut().find(|(k, _)| *k == c) {
        Some((_, n)) => *n += 1,
        None => v.push((c, 1)),
    }
}

/// Counts one guest message dropped (not routed, over a limit, refused),
/// by `reason`.
pub fn guest_dropped(reason: &'static str) {
    guest_dropped_n(reason, 1);
}

/// Counts `n` guest messages dropped for `reason`.
pub fn guest_dropped_n(reason: &'static str, n: u64) {
    let mut v = GUEST_DROPPED.lock().unwrap_or_else(|p| p.into_inner());
    match v.iter_mut().find(|(k, _)| *k == reason) {
        Some((_, c)) => *c += n,
        None => v.push((reason, n)),
    }
}

/// Records one restore (spawn or pool take → READY) duration.
pub fn restore_latency(d: std::time::Duration) {
    let s = d.as_secs_f64();
    let i = BUCKETS
        .iter()
        .position(|b| s <= *b)
        .unwrap_or(BUCKETS.len());
    RESTORE_BUCKETS[i].fetch_add(1, Ordering::Relaxed);
    RESTORE_SUM_US.fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    RESTORE_COUNT.fetch_add(1, Ordering::Relaxed);
}

/// Counts a warm VM that failed when a session took it (the session was
/// restored from the golden snapshot instead).
pub fn warm_fallback() {
    WARM_FALLBACKS.fetch_add(1, Ordering::Relaxed);
}

/// Counts a restore from the golden snapshot tried again because its vmm
/// exited, or its guest closed the channel, before the guest was ready.
pub fn restore_retry() {
    RESTORE_RETRIES.fetch_add(1, Ordering::Relaxed);
}

/// The gauges read from the session manager at each scrape.
#[derive(Debug, Clone, Default)]
pub struct Gauges {
    /// Sessions per state name.
    pub sessions_by_state: Vec<(&'static str, usize)>,
    /// Billed seconds and vCPU-seconds of every session's last usage record.
    pub usage_totals: (f64, f64),
    /// Guest channels whose exec clients do not keep up.
    pub guest_backpressured: usize,
    /// Guest packets the host-side egress rules dropped and DNS queries the
    /// sessions' resolvers refused, over the sessions in memory.
    pub denied_totals: (u64, u64),
    /// The fleet export, on a node in a fleet.
    pub fleet: Option<FleetGauges>,
}

/// The fleet export's state (see `crate::fleet::export`).
#[derive(Debug, Clone, Default)]
pub struct FleetGauges {
    /// Records waiting in the outbox.
    pub outbox_rows: u64,
    /// Age of the oldest waiting record, seconds (0: none waits).
    pub outbox_oldest_seconds: f64,
    /// Messages JetStream acknowledged.
    pub published: u64,
    /// Of those, the ones it had already (retries it dropped).
    pub duplicates: u64,
    /// Failed export spells (each retried).
    pub failures: u64,
}

/// Where the endpoint reads the [`Gauges`] from (the session manager), so
/// this module needs nothing above it.
pub trait GaugeSource: Send + Sync + 'static {
    /// The gauges now.
    fn gauges(&self) -> Gauges;
}

/// Renders all metrics in Prometheus text format.
pub fn render(g: &Gauges) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# TYPE hostagent_sessions gauge");
    for (state, n) in &g.sessions_by_state {
        let _ = writeln!(out, "hostagent_sessions{{state=\"{state}\"}} {n}");
    }
    let _ = writeln!(out, "# TYPE hostagent_restore_seconds histogram");
    let mut cum = 0;
    for (i, b) in BUCKETS.iter().enumerate() {
        cum += RESTORE_BUCKETS[i].load(Ordering::Relaxed);
        let _ = writeln!(out, "hostagent_restore_seconds_bucket{{le=\"{b}\"}} {cum}");
    }
    cum += RESTORE_BUCKETS[BUCKETS.len()].load(Ordering::Relaxed);
    let _ = writeln!(out, "hostagent_restore_seconds_bucket{{le=\"+Inf\"}} {cum}");
    let _ = writeln!(
        out,
        "hostagent_restore_seconds_sum {}",
        RESTORE_SUM_US.load(Ordering::Relaxed) as f64 / 1e6
    );
    let _ = writeln!(
        out,
        "hostagent_restore_seconds_count {}",
        RESTORE_COUNT.load(Ordering::Relaxed)
    );
    let _ = writeln!(out, "# TYPE hostagent_warm_pool_fallbacks_total counter");
    let _ = writeln!(
        out,
        "hostagent_warm_pool_fallbacks_total {}",
        WARM_FALLBACKS.load(Ordering::Relaxed)
    );
    let _ = writeln!(out, "# TYPE hostagent_restore_retries_total counter");
    let _ = writeln!(
        out,
        "hostagent_restore_retries_total {}",
        RESTORE_RETRIES.load(Ordering::Relaxed)
    );
    let u = g.usage_totals;
    let _ = writeln!(out, "# TYPE hostagent_usage_billed_seconds_total counter");
    let _ = writeln!(out, "hostagent_usage_billed_seconds_total {}", u.0);
    let _ = writeln!(out, "# TYPE hostagent_usage_vcpu_seconds_total counter");
    let _ = writeln!(out, "hostagent_usage_vcpu_seconds_total {}", u.1);
    let (packets, queries) = g.denied_totals;
    let _ = writeln!(out, "# TYPE hostagent_egress_denied_packets_total counter");
    let _ = writeln!(out, "hostagent_egress_denied_packets_total {packets}");
    let _ = writeln!(out, "# TYPE hostagent_dns_denied_queries_total counter");
    let _ = writeln!(out, "hostagent_dns_denied_queries_total {queries}");
    let _ = writeln!(out, "# TYPE hostagent_api_errors_total counter");
    for (code, n) in API_ERRORS.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        let name = format!("{:?}", tonic::Code::from_i32(*code));
        let _ = writeln!(out, "hostagent_api_errors_total{{code=\"{name}\"}} {n}");
    }
    let _ = writeln!(out, "# TYPE hostagent_guest_messages_dropped_total counter");
    for (reason, n) in GUEST_DROPPED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
    {
        let _ = writeln!(
            out,
            "hostagent_guest_messages_dropped_total{{reason=\"{reason}\"}} {n}"
        );
    }
    if let Some(f) = &g.fleet {
        let _ = writeln!(out, "# TYPE hostagent_fleet_outbox_records gauge");
        let _ = writeln!(out, "hostagent_fleet_outbox_records {}", f.outbox_rows);
        let _ = writeln!(out, "# TYPE hostagent_fleet_outbox_oldest_seconds gauge");
        let _ = writeln!(
            out,
            "hostagent_fleet_outbox_oldest_seconds {}",
            f.outbox_oldest_seconds
        );
        let _ = writeln!(out, "# TYPE hostagent_fleet_exported_total counter");
        let _ = writeln!(out, "hostagent_fleet_exported_total {}", f.published);
        let _ = writeln!(
            out,
            "# TYPE hostagent_fleet_export_duplicates_total counter"
        );
        let _ = writeln!(
            out,
            "hostagent_fleet_export_duplicates_total {}",
            f.duplicates
        );
        let _ = writeln!(out, "# TYPE hostagent_fleet_export_failures_total counter");
        let _ = writeln!(out, "hostagent_fleet_export_failures_total {}", f.failures);
    }
    let _ = writeln!(out, "# TYPE hostagent_guest_channels_backpressured gauge");
    let _ = writeln!(
        out,
        "hostagent_guest_channels_backpressured {}",
        g.guest_backpressured
    );
    out
}

/// Serves `GET /metrics` (any path) until the process exits.
pub async fn serve<S: GaugeSource>(listener: TcpListener, source: Arc<S>) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let source = source.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let _ =
                tokio::time::timeout(std::time::Duration::from_secs(5), sock.read(&mut buf)).await;
            let body = render(&source.gauges());
            let resp = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fleet_export_is_rendered_only_on_a_node_in_a_fleet() {
        let outside = render(&Gauges::default());
        assert!(!outside.contains("hostagent_fleet_"), "{outside}");
        let inside = render(&Gauges {
            fleet: Some(FleetGauges {
                outbox_rows: 7,
                outbox_oldest_seconds: 1.5,
                published: 40,
                duplicates: 2,
                failures: 1,
            }),
            ..Default::default()
        });
        for line in [
            "hostagent_fleet_outbox_records 7",
            "hostagent_fleet_outbox_oldest_seconds 1.5",
            "hostagent_fleet_exported_total 40",
            "hostagent_fleet_export_duplicates_total 2",
            "hostagent_fleet_export_failures_total 1",
        ] {
            assert!(
                inside.lines().any(|l| l == line),
                "{line} missing:\n{inside}"
            );
        }
    }
}
