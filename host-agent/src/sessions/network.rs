//! A session's egress policy: the allowlist and the extra denied blocks in
//! force in its VM's namespace. A session with a repository starts with
//! what the repository's `agent-manifest.yaml` (at the base commit) grants
//! its agent, within the node's allowlist ([`crate::network::grants`]); one
//! without (an image that does not run guest-init) starts with the node's.
//! It changes on a live session through UpdateSessionNetwork (narrowing
//! only, unless the caller is an admin), and is kept in the session's
//! directory so a restarted host-agent knows it.

use serde::{Deserialize, Serialize};

use super::*;
use crate::network::addressing::Cidr;
use crate::network::grants::{session_egress, HostGrant, SessionEgress};
use crate::network::node::parse_allow;
use crate::network::rules::Allow;
use crate::repo::Repo;

/// The file in a session's directory that holds its policy.
const POLICY_FILE: &str = "network-policy.json";
/// Most allow and deny entries one request may carry (the sets are the
/// kernel's: bounded so one client cannot make them huge).
pub const MAX_POLICY_ENTRIES: usize = 1024;
/// Largest manifest read from a repository (the guest reads no larger one).
const MANIFEST_LIMIT: u64 = 1 << 20;

/// A session's policy as kept on disk (the entries as written).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Kept {
    allow: Vec<String>,
    deny: Vec<String>,
    /// Host names granted by the manifest, for the session's resolver.
    #[serde(default)]
    hosts: Vec<KeptHost>,
}

/// A [`HostGrant`] as kept on disk.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct KeptHost {
    host: String,
    ports: Vec<u16>,
}

/// The manifest of session `row`'s repository at the commit its base ref
/// names (`None`: the commit has none). One that does not parse is
/// FAILED_PRECONDITION, as the guest would refuse it.
pub(super) async fn manifest_of(row: &SessionRow) -> Result<Option<agent_manifest::Manifest>> {
    let repo = Repo::open(&row.repository)?;
    let commit = repo.resolve_commit(&row.base_ref).await?;
    let path = agent_manifest::MANIFEST_PATH;
    let Some(text) = repo.file_at(&commit, path, MANIFEST_LIMIT).await? else {
        return Ok(None);
    };
    let text = String::from_utf8(text)
        .map_err(|_| Error::FailedPrecondition(format!("{path} at {commit} is not UTF-8 text")))?;
    agent_manifest::Manifest::parse(&text)
        .map(Some)
        .map_err(|e| Error::FailedPrecondition(format!("at {commit}: {e}")))
}

/// Writes the policy of the session in `dir` (made if it is not there yet).
fn keep(dir: &Path, allow: &[Allow], deny: &[Cidr], hosts: &[HostGrant]) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let kept = Kept {
        allow: allow.iter().map(Allow::to_string).collect(),
        deny: deny.iter().map(Cidr::to_string).collect(),
        hosts: hosts
            .iter()
            .map(|h| KeptHost {
                host: h.host.clone(),
                ports: h.ports.clone(),
            })
            .collect(),
    };
    let path = dir.join(POLICY_FILE);
    let text = serde_json::to_string(&kept)
        .map_err(|e| Error::Network(format!("encoding the session's policy: {e}")))?;
    std::fs::write(&path, text)
        .map_err(|e| Error::io(format!("keeping the policy in {}", path.display()), e))
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
    /// The node-side IPv6 address, if the VM has IPv6.
    pub vm_address6: Option<String>,
    /// Host names its resolver answers.
    pub hosts: Vec<String>,
    /// Its exposed ports.
    pub exposed: Vec<super::Exposed>,
}

impl Manager {
    /// The node's network for a VM of `image`: `None` when its golden
    /// snapshot has no network device, an error when it has one and this
    /// node has no network.
    pub(super) fn network_for(&self, image: &ImageRow) -> Result<Option<Arc<NodeNetwork>>> {
        if !has_network(image) {
            return Ok(None);
        }
        self.network.clone().map(Some).ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "image {}'s golden snapshot has a network device, but this node has no \
                 network configured: set `network` or rebuild the golden snapshot",
                image.id
            ))
        })
    }

    /// The egress session `row` starts with: its manifest's grant for its
    /// agent within the node's allowlist, or, without a repository, the
    /// node's allowlist. A manifest that does not parse fails the session,
    /// as it would in the guest.
    pub(super) async fn initial_egress(&self, row: &SessionRow) -> Result<SessionEgress> {
        let node: Vec<Allow> = self
            .network
            .as_ref()
            .map(|n| n.policy().allow.clone())
            .unwrap_or_default();
        if row.repository.is_empty() {
            return Ok(SessionEgress {
                allow: node,
                ..Default::default()
            });
        }
        let Some(manifest) = manifest_of(row).await? else {
            // No manifest: no egress, as in the guest.
            return Ok(SessionEgress::default());
        };
        let ipv6 = self.network.as_ref().is_some_and(|n| n.has_ipv6());
        session_egress(&manifest.grant(&row.agent).egress, &node, ipv6)
    }

    /// Records `egress` as session `sess`'s policy (in memory, and kept in
    /// `dir`).
    pub(super) fn start_policy(
        &self,
        sess: &Session,
        dir: &Path,
        egress: &SessionEgress,
    ) -> Result<()> {
        keep(dir, &egress.allow, &[], &egress.hosts)?;
        {
            let mut i = sess.lock();
            i.net_allow = egress.allow.clone();
            i.net_deny = vec![];
            i.net_hosts = egress.hosts.clone();
        }
        Ok(())
    }

    /// Says in session `sess`'s events what it was granted
    /// (`network_granted`, once per session: see `create.rs`).
    pub(super) fn note_granted(&self, sess: &Session, egress: &SessionEgress) -> Result<()> {
        let hosts: Vec<String> = egress.hosts.iter().map(|h| h.host.clone()).collect();
        let mut detail = format!(
            "allow: [{}]; hosts: [{}]",
            egress
                .allow
                .iter()
                .map(Allow::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            hosts.join(", ")
        );
        if !egress.skipped.is_empty() {
            detail.push_str(&format!("; skipped: [{}]", egress.skipped.join("; ")));
        }
        self.note(sess, "network_granted", &detail)
    }

    /// Makes `vm` session `sess`'s network: recorded with the session (its
    /// addresses in its row, kept) and said in its events
    /// (`network_attached`, with the addresses and the namespace).
    pub(super) fn attach_network(&self, sess: &Session, vm: VmNetwork) -> Result<()> {
        let addresses: Vec<String> = std::iter::once(vm.slot.vm_ip.to_string())
            .chain(vm.slot.v6.map(|v6| v6.vm_ip.to_string()))
            .collect();
        let detail = format!(
            "addresses: {}; namespace: {}",
            addresses.join(", "),
            vm.netns
        );
        {
            let mut i = sess.lock();
            i.network = Some(vm);
            i.row.vm_addresses = addresses.join(",");
            self.store.put_session(&i.row)?;
        }
        self.note(sess, "network_attached", &detail)
    }

    /// The policy kept in `dir` by an earlier run, if any.
    pub(super) fn kept_policy(dir: &Path) -> Option<(Vec<Allow>, Vec<Cidr>, Vec<HostGrant>)> {
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
            .map(|c| Cidr::parse(c))
            .collect::<Result<_>>();
        let hosts = kept
            .hosts
            .into_iter()
            .map(|h| HostGrant {
                host: h.host,
                ports: h.ports,
            })
            .collect();
        Some((allow.ok()?, deny.ok()?, hosts))
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
        if let Some(v6) = new_allow.iter().find(|a| !a.cidr.is_v4()) {
            if !node.has_ipv6() {
                return Err(Error::invalid(format!(
                    "allow entry \"{v6}\" is IPv6, and this node gives VMs no IPv6 \
                     (network.pool has no IPv6 block)"
                )));
            }
        }
        let new_deny: Vec<Cidr> = deny.iter().map(|c| Cidr::parse(c)).collect::<Result<_>>()?;
        let (vm, current_allow, mut all_deny, hosts, dir) = {
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
                i.net_hosts.clone(),
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
        // The sets change; what the resolver learned stays (and still
        // passes the new deny blocks first).
        tokio::task::spawn_blocking(move || applied.update_policy(&policy, false))
            .await
            .map_err(|e| Error::Network(format!("the network task failed: {e}")))??;
        keep(Path::new(&dir), &new_allow, &all_deny, &hosts)?;
        {
            let mut i = sess.lock();
            i.net_allow = new_allow;
            i.net_deny = all_deny;
        }
        let state = self
            .network_state(id)?
            .ok_or_else(|| Error::FailedPrecondition(format!("session {id} lost its network")))?;
        let detail = format!(
            "allow: [{}]; deny: [{}]",
            state.allow.join(", "),
            state.deny.join(", ")
        );
        self.note(&sess, "network_updated", &detail)?;
        Ok(state)
    }
}
