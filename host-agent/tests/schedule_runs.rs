//! Schedules firing: a schedule every second runs its command once per
//! fire time, each fire recorded once (ListRuns and Events.Watch kind
//! `schedule`); overlap SKIP and QUEUE with runs that outlast the period;
//! a SIGKILL and restart of host-agent across fire times gives one
//! catch-up run (catch_up ONCE) or a skip record and no run (NONE), never
//! a fire time twice; RunScheduleNow refused for capacity is retried with
//! backoff and recorded failed with the reason. The guest is the stand-in
//! of tests/common/fake_guest.rs.

mod common;

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use common::fake_guest::FakeGuest;
use common::*;
use proto::hostagent as pb;
use proto::hostagent::schedules_client::SchedulesClient;
use tonic::transport::Channel;

async fn client(agent: &Agent) -> SchedulesClient<Channel> {
    SchedulesClient::new(agent.channel().await)
}

/// A schedule of image "gi" on `repo` for `agent`, firing every second.
fn every_second(id: &str, repo: &Path, agent: &str, overlap: pb::Overlap) -> pb::Schedule {
    pb::Schedule {
        schedule_id: id.into(),
        cron: "* * * * * *".into(),
        session: Some(pb::CreateSessionRequest {
            image_id: "gi".into(),
            repository_path: repo.display().to_string(),
            agent: agent.into(),
            base_ref: "main".into(),
            ..Default::default()
        }),
        run: vec!["make".into(), "report".into()],
        overlap: overlap as i32,
        enabled: true,
        ..Default::default()
    }
}

async fn create(c: &mut SchedulesClient<Channel>, s: pb::Schedule) -> pb::Schedule {
    c.create_schedule(pb::CreateScheduleRequest { schedule: Some(s) })
        .await
        .expect("create schedule")
        .into_inner()
}

/// Disables schedule `id`; returns it (its updated_at is when it stopped).
async fn disable(c: &mut SchedulesClient<Channel>, id: &str) -> pb::Schedule {
    let s = c
        .get_schedule(pb::ScheduleRef {
            schedule_id: id.into(),
        })
        .await
        .unwrap()
        .into_inner();
    c.update_schedule(pb::UpdateScheduleRequest {
        schedule: Some(pb::Schedule {
            enabled: false,
            ..s
        }),
    })
    .await
    .expect("disable")
    .into_inner()
}

/// Every run of schedule `id`, oldest first.
async fn runs(c: &mut SchedulesClient<Channel>, id: &str) -> Vec<pb::ScheduleRun> {
    let mut all = c
        .list_runs(pb::ListRunsRequest {
            schedule_id: id.into(),
            page_size: 1000,
            ..Default::default()
        })
        .await
        .expect("list runs")
        .into_inner()
        .runs;
    all.reverse();
    all
}

fn over(r: &pb::ScheduleRun) -> bool {
    [
        pb::RunState::Succeeded as i32,
        pb::RunState::Failed as i32,
        pb::RunState::Skipped as i32,
    ]
    .contains(&r.state)
}

/// Waits until every run of `id` is over; returns them, oldest first.
async fn settled(
    agent: &Agent,
    c: &mut SchedulesClient<Channel>,
    id: &str,
) -> Vec<pb::ScheduleRun> {
    for _ in 0..600 {
        let all = runs(c, id).await;
        if all.iter().all(over) {
            return all;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "runs of {id} still open: {:#?}\nhost-agent's log:\n{}",
        runs(c, id).await,
        agent.log()
    );
}

fn state(r: &pb::ScheduleRun) -> pb::RunState {
    pb::RunState::try_from(r.state).unwrap()
}

/// The fire times a per-second cron has in `(after, until]` (ms).
fn seconds_between(after: i64, until: i64) -> i64 {
    until.div_euclid(1000) - after.div_euclid(1000)
}

/// Each fire time once, a second apart, in order.
fn check_once_each(all: &[pb::ScheduleRun]) {
    let keys: HashSet<&str> = all.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys.len(), all.len(), "a key twice: {all:#?}");
    for w in all.windows(2) {
        assert_eq!(w[1].fire_at - w[0].fire_at, 1000, "{:#?}", w);
        assert!(w[1].run_id > w[0].run_id);
    }
    for r in all {
        assert_eq!(r.key, format!("schedule:{}:{}", r.schedule_id, r.fire_at));
        assert_eq!(r.fire_at % 1000, 0, "a fire on the second: {r:?}");
    }
}

async fn agent_and_guest(extra: &[&str]) -> (Agent, FakeGuest) {
    let guest = FakeGuest::start();
    let mut args = vec![
        "--guest-vsock-uds",
        guest.sock().leak(),
        "--no-vsock-device",
    ];
    args.extend_from_slice(extra);
    let agent = Agent::start(&args);
    agent.guest_init_image().await;
    (agent, guest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_every_second_runs_its_command_once_per_fire() {
    let (agent, guest) = agent_and_guest(&[]).await;
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_main(dir.path());
    let mut c = client(&agent).await;
    let mut watch = agent
        .events()
        .await
        .watch(pb::WatchRequest {
            kinds: vec!["schedule".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();

    let made = create(
        &mut c,
        every_second("tick", &repo, "good", pb::Overlap::Allow),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(4500)).await;
    let stopped = disable(&mut c, "tick").await;
    let all = settled(&agent, &mut c, "tick").await;

    // N fire times in N seconds, within one (a fire due just before the
    // disable may not have been recorded yet: the disable drops it).
    let expected = seconds_between(made.created_at, stopped.updated_at);
    let n = all.len() as i64;
    assert!(
        n == expected || n == expected - 1,
        "{n} runs for {expected} fire times: {all:#?}"
    );
    assert!(n >= 3, "{all:#?}");
    check_once_each(&all);
    let sessions: HashSet<&str> = all.iter().map(|r| r.session_id.as_str()).collect();
    assert_eq!(sessions.len(), all.len(), "a session per run");
    for r in &all {
        assert_eq!(state(r), pb::RunState::Succeeded, "{r:?}");
        assert_eq!(r.cause, "cron");
        assert_eq!(
            r.exit.as_ref().and_then(|e| e.status),
            Some(pb::exec_exit::Status::Code(0))
        );
        assert_eq!(r.output_tail, b"ok\n");
        assert!(
            r.started_at >= r.fire_at && r.ended_at >= r.started_at,
            "{r:?}"
        );
        assert!(r.billed_seconds >= 1.0, "{r:?}");
        assert_eq!(r.attempts, 1);
        // The run's session was stopped when its command ended.
        let s = agent.get(&r.session_id).await;
        assert_eq!(s.state, S::Stopped as i32, "{s:?}");
        assert_eq!(s.reason, "run_ended");
    }
    // The command ran once in each session, as the turn of its run, told
    // which schedule and fire it is.
    let execs = guest.seen.execs.lock().unwrap().clone();
    for r in &all {
        let mine: Vec<_> = execs.iter().filter(|(s, _)| *s == r.session_id).collect();
        assert_eq!(mine.len(), 1, "{r:?}");
        let e = &mine[0].1;
        assert_eq!(e.argv, ["make", "report"]);
        assert_eq!(e.turn_id, format!("run-{}", r.run_id));
        assert_eq!(e.env["AGENTVM_SCHEDULE_ID"], "tick");
        assert_eq!(e.env["AGENTVM_FIRE_AT"], r.fire_at.to_string());
    }
    // Watchers of kind "schedule" saw each run fired, started and
    // succeeded, in that order, and nothing of the sessions' lifecycle.
    let mut seen: Vec<pb::Event> = Vec::new();
    while seen.iter().filter(|e| e.reason == "succeeded").count() < all.len() {
        let e = tokio::time::timeout(Duration::from_secs(10), watch.message())
            .await
            .expect("schedule events")
            .unwrap()
            .unwrap();
        seen.push(e);
    }
    for r in &all {
        let reasons: Vec<&str> = seen
            .iter()
            .filter(|e| e.run_id == r.run_id)
            .map(|e| e.reason.as_str())
            .collect();
        assert_eq!(reasons, ["fired", "started", "succeeded"], "{r:?}");
    }
    assert!(seen
        .iter()
        .all(|e| e.kind == "schedule" && e.schedule_id == "tick"));
    // Disabled, it fires no more.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(runs(&mut c, "tick").await.len(), all.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlap_skip_records_skips_and_queue_runs_one_after_another() {
    let (agent, _guest) = agent_and_guest(&[]).await;
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_main(dir.path());
    let mut c = client(&agent).await;
    // Each command takes 2.5 s: longer than the period.
    create(
        &mut c,
        every_second("skip", &repo, "slow-2500", pb::Overlap::Skip),
    )
    .await;
    create(
        &mut c,
        every_second("queue", &repo, "slow-1500", pb::Overlap::Queue),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(4500)).await;
    disable(&mut c, "skip").await;
    disable(&mut c, "queue").await;

    let skip = settled(&agent, &mut c, "skip").await;
    check_once_each(&skip);
    let ran: Vec<_> = skip
        .iter()
        .filter(|r| state(r) == pb::RunState::Succeeded)
        .collect();
    let skipped: Vec<_> = skip
        .iter()
        .filter(|r| state(r) == pb::RunState::Skipped)
        .collect();
    assert!(!ran.is_empty() && !skipped.is_empty(), "{skip:#?}");
    assert_eq!(ran.len() + skipped.len(), skip.len(), "{skip:#?}");
    for r in &skipped {
        assert_eq!(r.reason, "overlap", "{r:?}");
        assert!(r.session_id.is_empty(), "a skip has no session: {r:?}");
    }
    // Never two at once.
    for w in ran.windows(2) {
        assert!(w[1].started_at >= w[0].ended_at, "{:#?}", w);
    }

    let queue = settled(&agent, &mut c, "queue").await;
    check_once_each(&queue);
    // Every fire ran (up to the queue's bound), one after another, in order.
    assert!(
        queue.iter().all(|r| state(r) == pb::RunState::Succeeded),
        "{queue:#?}"
    );
    assert!(queue.len() >= 3, "{queue:#?}");
    for w in queue.windows(2) {
        assert!(w[1].started_at >= w[0].ended_at, "{:#?}", w);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_across_fire_times_catches_up_once_or_skips() {
    // No command: each run is its session's start, done as soon as the
    // session runs, so no run is cut off by the kill.
    let mut agent = Agent::start(&[]);
    agent.counter_image("counter").await;
    let mut c = client(&agent).await;
    for (id, catch_up) in [("once", pb::CatchUp::Once), ("none", pb::CatchUp::None)] {
        create(
            &mut c,
            pb::Schedule {
                schedule_id: id.into(),
                cron: "* * * * * *".into(),
                session: Some(pb::CreateSessionRequest {
                    image_id: "counter".into(),
                    limits: Some(pb::Limits {
                        ttl_seconds: 30,
                        idle_timeout_seconds: 0,
                    }),
                    ..Default::default()
                }),
                catch_up: catch_up as i32,
                overlap: pb::Overlap::Allow as i32,
                enabled: true,
                ..Default::default()
            },
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before: Vec<i64> = runs(&mut c, "once")
        .await
        .iter()
        .map(|r| r.fire_at)
        .collect();
    agent.kill9();
    let killed_at = pb_now();
    // Down across three fire times.
    tokio::time::sleep(Duration::from_millis(3300)).await;
    let restarted_at = pb_now();
    agent.spawn();
    let mut c = client(&agent).await;
    // Answered, so its scheduler has started: fire times before its start
    // (which may come a little after `restarted_at`) are the missed ones.
    runs(&mut c, "once").await;
    let answering_at = pb_now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for id in ["once", "none"] {
        disable(&mut c, id).await;
    }

    let once = settled(&agent, &mut c, "once").await;
    let none = settled(&agent, &mut c, "none").await;
    for all in [&once, &none] {
        let keys: HashSet<&str> = all.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(keys.len(), all.len(), "a fire time twice: {all:#?}");
        // Fire times of the clock come only while host-agent was up.
        for r in all.iter().filter(|r| r.cause == "cron") {
            assert!(
                r.fire_at <= killed_at || r.fire_at >= restarted_at,
                "fired while down: {r:?}"
            );
        }
        let mut fires: Vec<i64> = all.iter().map(|r| r.fire_at).collect();
        fires.sort();
        fires.dedup();
        assert_eq!(fires.len(), all.len(), "{all:#?}");
    }
    // Fires recorded before the kill kept their runs (none lost or redone).
    let kept: Vec<i64> = once
        .iter()
        .filter(|r| r.fire_at <= killed_at && r.cause == "cron")
        .map(|r| r.fire_at)
        .collect();
    assert!(
        before.iter().all(|t| kept.contains(t)),
        "{before:?} {once:#?}"
    );

    // ONCE: one run for the missed fire times, and it ran.
    let caught: Vec<_> = once.iter().filter(|r| r.cause == "catch_up").collect();
    assert_eq!(caught.len(), 1, "{once:#?}");
    let r = caught[0];
    assert_eq!(state(r), pb::RunState::Succeeded, "{r:?}");
    assert!(!r.session_id.is_empty());
    assert!(r.fires >= 2, "stands for the missed fires: {r:?}");
    assert!(
        r.fire_at > killed_at - 1000 && r.fire_at < answering_at,
        "{r:?}"
    );
    assert!(
        r.detail.contains("passed while host-agent was down"),
        "{r:?}"
    );
    // NONE: a record of the skip, and no session for it.
    let missed: Vec<_> = none.iter().filter(|r| r.cause == "missed").collect();
    assert_eq!(missed.len(), 1, "{none:#?}");
    let m = missed[0];
    assert_eq!(
        (state(m), m.reason.as_str()),
        (pb::RunState::Skipped, "missed")
    );
    assert!(m.session_id.is_empty() && m.fires >= 2, "{m:?}");
    assert!(none.iter().all(|r| r.cause != "catch_up"));
    // And both fire again after the restart.
    for all in [&once, &none] {
        assert!(
            all.iter()
                .any(|r| r.cause == "cron" && r.fire_at >= restarted_at),
            "{all:#?}"
        );
    }
}

fn pb_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_refused_for_capacity_is_retried_then_recorded_failed() {
    let agent = Agent::start(&["--max-sessions", "1", "--schedule-retry-window", "4"]);
    agent.counter_image("counter").await;
    let mut c = client(&agent).await;
    create(
        &mut c,
        pb::Schedule {
            schedule_id: "full".into(),
            // Never fires by itself in this test: the 1st of January only.
            cron: "0 0 0 1 1 *".into(),
            session: Some(pb::CreateSessionRequest {
                image_id: "counter".into(),
                ..Default::default()
            }),
            enabled: true,
            ..Default::default()
        },
    )
    .await;
    let blocker = agent.create("counter", "").await;
    let run = c
        .run_schedule_now(pb::RunScheduleNowRequest {
            schedule_id: "full".into(),
        })
        .await
        .expect("run now")
        .into_inner();
    assert_eq!(run.cause, "manual");
    assert_eq!(state(&run), pb::RunState::Pending);
    let all = settled(&agent, &mut c, "full").await;
    assert_eq!(all.len(), 1);
    let r = &all[0];
    assert_eq!(
        (state(r), r.reason.as_str()),
        (pb::RunState::Failed, "capacity"),
        "{r:?}"
    );
    assert!(r.attempts >= 2, "retried with backoff: {r:?}");
    assert!(r.detail.contains("live sessions"), "{r:?}");
    assert!(r.session_id.is_empty());

    // With room, the next one runs.
    agent.stop(&blocker.session_id).await;
    c.run_schedule_now(pb::RunScheduleNowRequest {
        schedule_id: "full".into(),
    })
    .await
    .unwrap();
    let all = settled(&agent, &mut c, "full").await;
    assert_eq!(all.len(), 2);
    assert_eq!(state(&all[1]), pb::RunState::Succeeded, "{:?}", all[1]);
    assert!(!all[1].session_id.is_empty());
    // Unknown schedules are NOT_FOUND.
    let e = c
        .run_schedule_now(pb::RunScheduleNowRequest {
            schedule_id: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_cut_off_by_a_restart_is_recorded_failed_and_its_session_stopped() {
    let guest = FakeGuest::start();
    let sock = guest.sock();
    let mut agent = Agent::start(&["--guest-vsock-uds", &sock, "--no-vsock-device"]);
    agent.guest_init_image().await;
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_main(dir.path());
    let mut c = client(&agent).await;
    create(
        &mut c,
        pb::Schedule {
            cron: "0 0 0 1 1 *".into(),
            ..every_second("long", &repo, "slow-60000", pb::Overlap::Skip)
        },
    )
    .await;
    let run = c
        .run_schedule_now(pb::RunScheduleNowRequest {
            schedule_id: "long".into(),
        })
        .await
        .unwrap()
        .into_inner();
    // Wait until its command runs, then kill host-agent under it.
    let mut running = None;
    for _ in 0..300 {
        let r = runs(&mut c, "long").await.remove(0);
        if state(&r) == pb::RunState::Running {
            running = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let running = running.unwrap_or_else(|| panic!("never RUNNING: {}", agent.log()));
    assert_eq!(running.run_id, run.run_id);
    agent.kill9();
    agent.spawn();
    let mut c = client(&agent).await;
    let all = settled(&agent, &mut c, "long").await;
    assert_eq!(all.len(), 1, "not run again: {all:#?}");
    let r = &all[0];
    assert_eq!(
        (state(r), r.reason.as_str()),
        (pb::RunState::Failed, "host_agent_restarted"),
        "{r:?}"
    );
    // Its session is stopped, not left running for its TTL.
    let stopped = agent.wait_state(&r.session_id, S::Stopped).await;
    assert_eq!(stopped.reason, "run_ended", "{stopped:?}");
}
