//! The session's egress rules: applying the manifest's allowlist with
//! nftables (resolving its names) and reporting denied connections at the
//! end of a turn.

use super::*;

impl Session {
    pub(super) async fn apply_egress(&self, plan: &EgressPlan) -> Result<(), String> {
        let mut plan = plan.clone();
        if self.cfg.apply_egress {
            plan.allow_nameservers(&nameservers());
        }
        let plan = &plan;
        for (ip, host) in &plan.refused {
            self.audit(Entry {
                actor: "guest-init",
                action: "egress.denied",
                resource: &format!("{host} -> {ip}"),
                decision: "deny",
                result: "private, loopback, link-local or metadata address not listed as a cidr",
                turn_id: "",
            })
            .await;
        }
        let summary = plan
            .allowed
            .iter()
            .map(|a| format!("{} ports {:?}", a.cidr, a.ports))
            .collect::<Vec<_>>()
            .join(", ");
        if !self.cfg.apply_egress {
            self.audit(Entry {
                actor: "guest-init",
                action: "egress.planned",
                resource: &summary,
                result: "not applied: serve mode without --apply-egress",
                ..Default::default()
            })
            .await;
            return Ok(());
        }
        std::fs::write(&self.cfg.hosts_file, egress::hosts_file(plan))
            .map_err(|e| format!("cannot write {}: {e}", self.cfg.hosts_file.display()))?;
        run_nft(&egress::nft_ruleset(plan)).await?;
        self.audit(Entry {
            actor: "guest-init",
            action: "egress.applied",
            resource: &summary,
            result: "nftables table inet guest_egress installed",
            ..Default::default()
        })
        .await;
        Ok(())
    }

    pub(super) async fn report_egress_denials(&self, turn_id: &str) {
        if !self.cfg.apply_egress {
            return;
        }
        let Ok(out) = reaper::output(tokio::process::Command::new("nft").args([
            "list",
            "counter",
            "inet",
            egress::TABLE,
            "denied",
        ]))
        .await
        else {
            return;
        };
        let Some(now) = egress::parse_denied_packets(&String::from_utf8_lossy(&out.stdout)) else {
            return;
        };
        let before = std::mem::replace(&mut *lock(&self.egress_denied), now);
        if now > before {
            self.audit(Entry {
                turn_id,
                actor: "agent",
                action: "egress.denied",
                resource: "outbound packets",
                decision: "deny",
                result: &format!("{} packets denied", now - before),
            })
            .await;
        }
    }
}

/// The DNS servers the kernel's `ip=` parameter names (the host's
/// per-session resolver), which the egress table lets port 53 through to.
/// Read from /proc/cmdline, which nothing in the guest can change.
fn nameservers() -> Vec<std::net::IpAddr> {
    crate::pid1::cmdline::Cmdline::read()
        .ip
        .map(|ip| ip.dns.into_iter().map(std::net::IpAddr::V4).collect())
        .unwrap_or_default()
}

pub(super) fn resolve(host: &str) -> Vec<std::net::IpAddr> {
    use std::net::ToSocketAddrs;
    (host, 0)
        .to_socket_addrs()
        .map(|it| it.map(|a| a.ip()).collect())
        .unwrap_or_default()
}

pub(super) async fn run_nft(script: &str) -> Result<(), String> {
    let mut child = reaper::spawn(
        tokio::process::Command::new("nft")
            .args(["-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped()),
    )
    .map_err(|e| format!("cannot run nft (egress rules need nftables): {e}"))?;
    let pid = child.id();
    if let Some(mut w) = child.stdin.take() {
        w.write_all(script.as_bytes())
            .await
            .map_err(|e| format!("writing to nft: {e}"))?;
    }
    let out = child.wait_with_output().await;
    reaper::release(pid);
    let out = out.map_err(|e| format!("nft: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "nft refused the egress rules: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}
