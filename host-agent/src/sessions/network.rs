//! A session's egress policy: the allowlist and the extra denied blocks in
//! force in its VM's namespace. It starts as the node's, changes on a live
//! session through UpdateSessionNetwork (narrowing only, unless the caller
//! is an admin), and is kept in the session's directory so a restarted
//! host-agent knows it.

use serde::{Deserialize, Serialize};

use super::*;
use crate::network::addressing::Cidr4;
use crate::network::node::parse_allow;
use crate::network::rules::Allow;

/// The file in a session's directory that holds its policy.
const POLICY_FILE: &str = "network-policy.json";
/// Most allow and deny entries one request may carry (the sets are the
/// kernel's: bounded so one client cannot make them huge).
pub const MAX_POLICY_ENTRIES: usize = 1024;

/// A session's policy as kept on disk (the entries as written).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Kept {
    allow: Vec<String>,
    deny: Vec<String>,
}

/// A session's network as UpdateSessionNetwork reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkState {
    /// The allowlist in force.
    pub allow: Vec<String>,
    /// Blocks denied to this session on top of the node's.
    pub deny: Vec<String>,
    /// The node-side address the guest is NATed to.
    pub vm_address: String,
}

impl Manager {
    /// The policy a session of this node starts with (the node's allowlist).
    pub(super) fn initial_policy(&self) -> (Vec<Allow>, Vec<Cidr4>) {
        let allow = self
            .network
            .as_ref()
            .map(|n| n.policy().allow.clone())
            .unwrap_or_default();
        (allow, vec![])
    }

    /// The policy kept in `dir` by an earlier run, if any.
    pub(super) fn kept_policy(dir: &Path) -> Option<(Vec<Allow>, Vec<Cidr4>)> {
        let text = std::fs::read_to_string(dir.join(POLICY_FILE)).ok()?;
        let kept: Kept = serde_json::from_str(&text).ok()?;
        let allow = kept
            .allow
            .iter()
            .map(|a| parse_allow(a))
            .collect::<Result<_>>();
        let deny = kept
            .deny
            .iter()
            .map(|c| Cidr4::parse(c))
            .collect::<Result<_>>();
        Some((allow.ok()?, deny.ok()?))
    }

    /// Replaces the allowlist of live session `id` and adds `deny` blocks.
    /// Without `may_widen`, every new entry must lie within a current one.
    pub async fn update_network(
        &self,
        id: &str,
        allow: &[String],
        deny: &[String],
        may_widen: bool,
    ) -> Result<NetworkState> {
        if allow.len() + deny.len() > MAX_POLICY_ENTRIES {
            return Err(Error::invalid(format!(
                "{} allow and deny entries; at most {MAX_POLICY_ENTRIES}",
                allow.len() + deny.len()
            )));
        }
        let sess = self.session(id)?;
        let _op = sess.op.lock().await;
        let node = self.network.clone().ok_or_else(|| {
            Error::FailedPrecondition("this node has no network configured".into())
        })?;
        let new_allow: Vec<Allow> = allow
            .iter()
            .map(|a| parse_allow(a))
            .collect::<Result<_>>()?;
        let new_deny: Vec<Cidr4> = deny
            .iter()
            .map(|c| Cidr4::parse(c))
            .collect::<Result<_>>()?;
        let (vm, current_allow, mut all_deny, dir) = {
            let i = sess.lock();
            if is_terminal(i.row.state) {
                return Err(Error::FailedPrecondition(format!(
                    "session {id} is {}; its network is gone",
                    state_name(i.row.state)
                )));
            }
            let vm = i.network.clone().ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "session {id} has no network (its image's golden snapshot has no network device)"
                ))
            })?;
            (
                vm,
                i.net_allow.clone(),
                i.net_deny.clone(),
                i.row.dir.clone(),
            )
        };
        if !may_widen {
            if let Some(wider) = new_allow
                .iter()
                .find(|a| !current_allow.iter().any(|c| c.covers(a)))
            {
                return Err(Error::PermissionDenied(format!(
                    "allow entry \"{wider}\" is not within session {id}'s current allowlist; \
                     widening it needs the admin scope"
                )));
            }
        }
        for d in new_deny {
            if !all_deny.contains(&d) {
                all_deny.push(d);
            }
        }
        let mut policy = node.policy().clone();
        policy.allow = new_allow.clone();
        policy.always_deny.extend(all_deny.iter().copied());
        let applied = vm.clone();
        tokio::task::spawn_blocking(move || applied.update_policy(&policy))
            .await
            .map_err(|e| Error::Network(format!("the network task failed: {e}")))??;
        let state = NetworkState {
            allow: new_allow.iter().map(Allow::to_string).collect(),
            deny: all_deny.iter().map(Cidr4::to_string).collect(),
            vm_address: vm.slot.vm_ip.to_string(),
        };
        {
            let mut i = sess.lock();
            i.net_allow = new_allow;
            i.net_deny = all_deny;
        }
        let kept = Kept {
            allow: state.allow.clone(),
            deny: state.deny.clone(),
        };
        let path = Path::new(&dir).join(POLICY_FILE);
        let text = serde_json::to_string(&kept)
            .map_err(|e| Error::Network(format!("encoding the session's policy: {e}")))?;
        std::fs::write(&path, text)
            .map_err(|e| Error::io(format!("keeping the policy in {}", path.display()), e))?;
        let detail = format!(
            "allow: [{}]; deny: [{}]",
            state.allow.join(", "),
            state.deny.join(", ")
        );
        self.note(&sess, "network_updated", &detail)?;
        Ok(state)
    }
}
