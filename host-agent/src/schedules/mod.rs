//! Schedules: sessions started by a clock, kept in host-agent's database
//! so they outlive restarts and need no control plane to be up.
//!
//! * [`cadence`]: the cron expression in its time zone, and the fire times
//!   it gives.
//! * [`ScheduleRow`]: a schedule as stored, checked from the API's
//!   `Schedule` by [`ScheduleRow::from_request`].
//!
//! What a schedule holds is checked when it is created or updated, the
//! session template as CreateSession would check it, so a schedule that is
//! stored is one that can fire.

pub mod cadence;
pub mod runner;
pub mod scheduler;
pub mod triggers;
pub mod webhook;

use proto::hostagent as pb;

use crate::error::{Error, Result};
pub use cadence::Cadence;
pub use scheduler::Scheduler;

/// Longest schedule id (its runs' keys, `schedule:<id>:<unix ms>`, stay
/// within an idempotency key's 128 bytes).
pub const MAX_ID_LEN: usize = 100;
/// Most arguments a run's command may have.
pub const MAX_RUN_ARGS: usize = 256;
/// Longest argument of a run's command.
pub const MAX_RUN_ARG_LEN: usize = 4096;

/// A schedule as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleRow {
    /// Its id.
    pub id: String,
    /// The client that created it; its runs' sessions are that client's.
    pub owner: String,
    /// The cron expression.
    pub cron: String,
    /// The IANA zone it is read in (empty: UTC).
    pub timezone: String,
    /// The CreateSession request each run makes (no inline secrets, no
    /// idempotency key).
    pub template: pb::CreateSessionRequest,
    /// The command each run executes (empty: the session only starts).
    pub run: Vec<String>,
    /// `pb::Overlap`, never unspecified.
    pub overlap: i32,
    /// `pb::CatchUp`, never unspecified.
    pub catch_up: i32,
    /// Whether it fires.
    pub enabled: bool,
    /// Unix ms.
    pub created_at: i64,
    /// Unix ms.
    pub updated_at: i64,
    /// The scope its owner had when it was created or last changed; its
    /// runs' sessions are created with it.
    pub owner_scope: String,
    /// Every fire time up to this (unix ms) is recorded, or came before
    /// the schedule was created or last changed.
    pub fired_through: i64,
}

/// Checks a schedule id: 1..=[`MAX_ID_LEN`] of `[A-Za-z0-9._-]`, not
/// starting with '.'.
pub fn check_id(id: &str) -> Result<()> {
    crate::images::check_name("schedule_id", id, MAX_ID_LEN)
}

/// A `pb::RunState`'s name without its `RUN_STATE_` prefix ("PENDING"),
/// as the webhook's answers and the CLI say it.
pub fn run_state_name(state: i32) -> &'static str {
    pb::RunState::try_from(state).map_or("UNSPECIFIED", |s| {
        let name = s.as_str_name();
        name.strip_prefix("RUN_STATE_").unwrap_or(name)
    })
}

/// The session template a schedule (or trigger) stores: present, without
/// inline secrets or an idempotency key, and as `check_session` (which
/// sees it as CreateSession would) allows; its errors name `session.*`.
pub fn check_template(
    template: Option<pb::CreateSessionRequest>,
    check_session: impl FnOnce(&pb::CreateSessionRequest) -> Result<()>,
) -> Result<pb::CreateSessionRequest> {
    let Some(template) = template else {
        return Err(Error::invalid(
            "session: a schedule needs the session template its runs create",
        ));
    };
    if !template.secrets.is_empty() {
        return Err(Error::invalid(
            "session.secrets: a schedule is kept in host-agent's database, so it takes no \
             secret values; name them in session.secret_refs (files in secrets_dir)",
        ));
    }
    if !template.idempotency_key.is_empty() {
        return Err(Error::invalid(
            "session.idempotency_key: each run's session gets schedule:<id>:<fire time> \
             as its key; leave it empty",
        ));
    }
    check_session(&template).map_err(|e| match e {
        Error::InvalidArgument(m) => Error::invalid(format!("session: {m}")),
        other => other,
    })?;
    Ok(template)
}

/// A run's command: at most [`MAX_RUN_ARGS`] arguments of at most
/// [`MAX_RUN_ARG_LEN`] bytes without NUL, the program not empty (an empty
/// command is allowed: the session only starts).
pub fn check_run(run: &[String]) -> Result<()> {
    if run.len() > MAX_RUN_ARGS {
        return Err(Error::invalid(format!(
            "run has {} arguments, more than {MAX_RUN_ARGS}",
            run.len()
        )));
    }
    if run.first().is_some_and(|a| a.is_empty()) {
        return Err(Error::invalid("run[0] (the program) is empty"));
    }
    if let Some((i, a)) = run
        .iter()
        .enumerate()
        .find(|(_, a)| a.len() > MAX_RUN_ARG_LEN || a.contains('\0'))
    {
        return Err(Error::invalid(format!(
            "run[{i}] is longer than {MAX_RUN_ARG_LEN} bytes or holds a NUL ({} bytes)",
            a.len()
        )));
    }
    Ok(())
}

impl ScheduleRow {
    /// The schedule `s` asks for, owned by `owner`, checked field by field
    /// (errors name the field). An empty id gets a new one. The session
    /// template is checked by `check_session`, which sees it as
    /// CreateSession would.
    pub fn from_request(
        s: pb::Schedule,
        owner: &crate::auth::Caller,
        now_ms: i64,
        check_session: impl FnOnce(&pb::CreateSessionRequest) -> Result<()>,
    ) -> Result<ScheduleRow> {
        let id = if s.schedule_id.is_empty() {
            uuid::Uuid::new_v4().to_string()
        } else {
            check_id(&s.schedule_id)?;
            s.schedule_id
        };
        Cadence::parse(&s.cron, &s.timezone)?;
        let template = check_template(s.session, check_session)?;
        check_run(&s.run)?;
        let overlap = match pb::Overlap::try_from(s.overlap) {
            Ok(pb::Overlap::Unspecified) => pb::Overlap::Skip,
            Ok(o) => o,
            Err(_) => {
                return Err(Error::invalid(format!(
                    "overlap {} is not one of SKIP, QUEUE, ALLOW",
                    s.overlap
                )))
            }
        };
        let catch_up = match pb::CatchUp::try_from(s.catch_up) {
            Ok(pb::CatchUp::Unspecified) => pb::CatchUp::None,
            Ok(c) => c,
            Err(_) => {
                return Err(Error::invalid(format!(
                    "catch_up {} is not one of NONE, ONCE",
                    s.catch_up
                )))
            }
        };
        Ok(ScheduleRow {
            id,
            owner: owner.name.clone(),
            owner_scope: owner.scope.name().to_string(),
            fired_through: now_ms,
            cron: s.cron,
            timezone: s.timezone,
            template,
            run: s.run,
            overlap: overlap as i32,
            catch_up: catch_up as i32,
            enabled: s.enabled,
            created_at: now_ms,
            updated_at: now_ms,
        })
    }

    /// The schedule as the API reports it; `next_fire_at` after `now_ms`.
    pub fn to_pb(&self, now_ms: i64) -> pb::Schedule {
        let next = if self.enabled {
            Cadence::parse(&self.cron, &self.timezone)
                .ok()
                .and_then(|c| c.next_after(now_ms))
                .unwrap_or(0)
        } else {
            0
        };
        pb::Schedule {
            schedule_id: self.id.clone(),
            cron: self.cron.clone(),
            timezone: self.timezone.clone(),
            session: Some(self.template.clone()),
            run: self.run.clone(),
            overlap: self.overlap,
            catch_up: self.catch_up,
            enabled: self.enabled,
            created_at: self.created_at,
            updated_at: self.updated_at,
            next_fire_at: next,
            owner: self.owner.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> pb::Schedule {
        pb::Schedule {
            schedule_id: "monday-report".into(),
            cron: "0 9 * * MON".into(),
            timezone: "Europe/Berlin".into(),
            session: Some(pb::CreateSessionRequest {
                image_id: "img".into(),
                ..Default::default()
            }),
            run: vec!["sh".into(), "-c".into(), "make report".into()],
            enabled: true,
            ..Default::default()
        }
    }

    fn alice() -> crate::auth::Caller {
        crate::auth::Caller {
            name: "alice".into(),
            scope: crate::auth::Scope::Sessions,
        }
    }

    fn check(s: pb::Schedule) -> Result<ScheduleRow> {
        ScheduleRow::from_request(s, &alice(), 1_000, |_| Ok(()))
    }

    #[test]
    fn a_good_schedule_is_taken_with_defaults() {
        let row = check(request()).unwrap();
        assert_eq!(row.overlap, pb::Overlap::Skip as i32);
        assert_eq!(row.catch_up, pb::CatchUp::None as i32);
        assert_eq!((row.owner.as_str(), row.created_at), ("alice", 1_000));
        let generated = check(pb::Schedule {
            schedule_id: String::new(),
            ..request()
        })
        .unwrap();
        assert_eq!(generated.id.len(), 36);
        // Reported with its next fire time; none while disabled.
        let at = row.to_pb(0);
        assert!(at.next_fire_at > 0);
        let off = ScheduleRow {
            enabled: false,
            ..row
        };
        assert_eq!(off.to_pb(0).next_fire_at, 0);
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases: Vec<(pb::Schedule, &str)> = vec![
            (
                pb::Schedule {
                    schedule_id: ".x".into(),
                    ..request()
                },
                "schedule_id",
            ),
            (
                pb::Schedule {
                    schedule_id: "a/b".into(),
                    ..request()
                },
                "schedule_id",
            ),
            (
                pb::Schedule {
                    cron: "0 25 * * *".into(),
                    ..request()
                },
                "cron",
            ),
            (
                pb::Schedule {
                    timezone: "Europe/Atlantis".into(),
                    ..request()
                },
                "timezone",
            ),
            (
                pb::Schedule {
                    session: None,
                    ..request()
                },
                "session",
            ),
            (
                pb::Schedule {
                    session: Some(pb::CreateSessionRequest {
                        image_id: "img".into(),
                        secrets: [("K".to_string(), "v".to_string())].into(),
                        ..Default::default()
                    }),
                    ..request()
                },
                "session.secrets",
            ),
            (
                pb::Schedule {
                    session: Some(pb::CreateSessionRequest {
                        image_id: "img".into(),
                        idempotency_key: "k".into(),
                        ..Default::default()
                    }),
                    ..request()
                },
                "session.idempotency_key",
            ),
            (
                pb::Schedule {
                    run: vec![String::new()],
                    ..request()
                },
                "run[0]",
            ),
            (
                pb::Schedule {
                    run: vec!["a".into(), "b\0".into()],
                    ..request()
                },
                "run[1]",
            ),
            (
                pb::Schedule {
                    run: vec!["a".into(); MAX_RUN_ARGS + 1],
                    ..request()
                },
                "run has",
            ),
            (
                pb::Schedule {
                    overlap: 9,
                    ..request()
                },
                "overlap 9",
            ),
            (
                pb::Schedule {
                    catch_up: 9,
                    ..request()
                },
                "catch_up 9",
            ),
        ];
        for (s, field) in cases {
            let e = check(s).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{field}: {e:?}");
            assert!(e.to_string().contains(field), "{field}: {e}");
        }
        // The template's own check speaks of the session's fields.
        let e = ScheduleRow::from_request(request(), &alice(), 0, |_| {
            Err(Error::invalid("image_id must be 1 to 64 characters, got 0"))
        })
        .unwrap_err();
        assert!(e.to_string().contains("session: image_id"), "{e}");
    }
}
