//! The Schedules service: schedules created, read, listed, changed and
//! deleted through gRPC; every bad field refused with INVALID_ARGUMENT
//! naming it; the next fire time computed in the schedule's zone; and the
//! schedules kept across a SIGKILL and restart of host-agent.

use chrono::{Datelike, TimeZone, Timelike};
use proto::hostagent as pb;
use proto::hostagent::schedules_client::SchedulesClient;
use test_harness::agent::Agent;
use tonic::transport::Channel;
use tonic::Code;

/// Registers the counter guest as image `id` that runs guest-init (its
/// golden snapshot is not built: schedules only check their template).
async fn guest_init_image(agent: &Agent, id: &str) {
    agent
        .images()
        .await
        .register_image(pb::RegisterImageRequest {
            image_id: id.into(),
            kernel_path: test_harness::guests::counter_kernel(),
            mem_mib: 32,
            guest_init: true,
            ..Default::default()
        })
        .await
        .expect("register image");
}

async fn client(agent: &Agent) -> SchedulesClient<Channel> {
    SchedulesClient::new(agent.channel().await)
}

fn monday_report(image: &str) -> pb::Schedule {
    pb::Schedule {
        schedule_id: "monday-report".into(),
        cron: "0 9 * * MON".into(),
        timezone: "Europe/Berlin".into(),
        session: Some(pb::CreateSessionRequest {
            image_id: image.into(),
            labels: [("team".to_string(), "data".to_string())].into(),
            ..Default::default()
        }),
        run: vec!["make".into(), "report".into()],
        overlap: pb::Overlap::Queue as i32,
        catch_up: pb::CatchUp::Once as i32,
        enabled: true,
        ..Default::default()
    }
}

async fn create(
    c: &mut SchedulesClient<Channel>,
    s: pb::Schedule,
) -> Result<pb::Schedule, tonic::Status> {
    c.create_schedule(pb::CreateScheduleRequest { schedule: Some(s) })
        .await
        .map(|r| r.into_inner())
}

fn by_id(id: &str) -> pb::ScheduleRef {
    pb::ScheduleRef {
        schedule_id: id.into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_are_kept_checked_and_report_their_next_fire() {
    let mut agent = Agent::start(&[]);
    guest_init_image(&agent, "counter").await;
    agent.counter_image("plain").await;
    let mut c = client(&agent).await;

    let made = create(&mut c, monday_report("counter")).await.unwrap();
    assert_eq!(made.schedule_id, "monday-report");
    assert_eq!(
        (made.overlap, made.catch_up),
        (pb::Overlap::Queue as i32, pb::CatchUp::Once as i32)
    );
    assert!(
        made.created_at > 0 && made.updated_at == made.created_at,
        "{made:?}"
    );
    assert_eq!(made.owner, "local");
    // The next fire is a Monday at 09:00 in Berlin, within a week.
    let berlin: chrono_tz::Tz = "Europe/Berlin".parse().unwrap();
    let next = berlin.timestamp_millis_opt(made.next_fire_at).unwrap();
    assert_eq!(
        (next.weekday(), next.hour(), next.minute(), next.second()),
        (chrono::Weekday::Mon, 9, 0, 0),
        "{next}"
    );
    let now = chrono::Utc::now().timestamp_millis();
    assert!(made.next_fire_at > now && made.next_fire_at <= now + 7 * 86_400_000);

    // The same id again is ALREADY_EXISTS; an empty id gets a new one.
    let again = create(&mut c, monday_report("counter")).await.unwrap_err();
    assert_eq!(again.code(), Code::AlreadyExists, "{again:?}");
    let unnamed = create(
        &mut c,
        pb::Schedule {
            schedule_id: String::new(),
            cron: "*/5 * * * * *".into(),
            timezone: String::new(),
            ..monday_report("counter")
        },
    )
    .await
    .unwrap();
    assert_eq!(unnamed.schedule_id.len(), 36);

    // Bad fields, each named.
    let bad: Vec<(pb::Schedule, &str)> = vec![
        (
            pb::Schedule {
                cron: "0 9 * * FUNDAY".into(),
                ..monday_report("counter")
            },
            "cron",
        ),
        (
            pb::Schedule {
                timezone: "Europe/Atlantis".into(),
                ..monday_report("counter")
            },
            "timezone",
        ),
        (
            pb::Schedule {
                schedule_id: "../x".into(),
                ..monday_report("counter")
            },
            "schedule_id",
        ),
        (
            monday_report("no-such-image"),
            "session: image_id \"no-such-image\"",
        ),
        (
            pb::Schedule {
                session: None,
                ..monday_report("counter")
            },
            "session",
        ),
        (
            pb::Schedule {
                run: vec![String::new()],
                ..monday_report("counter")
            },
            "run[0]",
        ),
        // A command needs guest-init to run it.
        (
            pb::Schedule {
                schedule_id: "plain".into(),
                ..monday_report("plain")
            },
            "runs no guest-init",
        ),
        (
            pb::Schedule {
                overlap: 7,
                ..monday_report("counter")
            },
            "overlap",
        ),
    ];
    for (s, field) in bad {
        let e = create(
            &mut c,
            pb::Schedule {
                // Never the stored one's id (a bad id stays as it is).
                schedule_id: if s.schedule_id == "monday-report" {
                    "bad".into()
                } else {
                    s.schedule_id.clone()
                },
                ..s
            },
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{field}: {e:?}");
        assert!(e.message().contains(field), "{field}: {}", e.message());
    }
    let mut secret = monday_report("counter");
    secret.schedule_id = "bad".into();
    secret.session.as_mut().unwrap().secrets =
        [("TOKEN".to_string(), "s3cr3t-value".to_string())].into();
    let e = create(&mut c, secret).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("session.secrets"), "{}", e.message());
    assert!(
        !e.message().contains("s3cr3t-value"),
        "no value echoed: {}",
        e.message()
    );
    assert_eq!(
        c.get_schedule(by_id("bad")).await.unwrap_err().code(),
        Code::NotFound,
        "nothing refused was kept"
    );

    // Changed: another time, disabled; its creation time stays.
    let changed = c
        .update_schedule(pb::UpdateScheduleRequest {
            schedule: Some(pb::Schedule {
                cron: "30 17 * * FRI".into(),
                enabled: false,
                ..monday_report("counter")
            }),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(changed.cron, "30 17 * * FRI");
    assert_eq!(changed.created_at, made.created_at);
    assert!(changed.updated_at >= made.updated_at);
    assert_eq!(changed.next_fire_at, 0, "a disabled schedule does not fire");
    let missing = c
        .update_schedule(pb::UpdateScheduleRequest {
            schedule: Some(pb::Schedule {
                schedule_id: "nope".into(),
                ..monday_report("counter")
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);

    // Kept across a SIGKILL and a restart.
    agent.kill9();
    agent.spawn();
    let mut c = client(&agent).await;
    let listed = c
        .list_schedules(pb::ListSchedulesRequest {})
        .await
        .unwrap()
        .into_inner()
        .schedules;
    let ids: Vec<&str> = listed.iter().map(|s| s.schedule_id.as_str()).collect();
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert!(ids.contains(&"monday-report") && ids.contains(&unnamed.schedule_id.as_str()));
    let kept = c
        .get_schedule(by_id("monday-report"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            kept.cron.as_str(),
            kept.enabled,
            kept.run.clone(),
            kept.session.clone()
        ),
        (
            changed.cron.as_str(),
            false,
            changed.run.clone(),
            changed.session.clone()
        )
    );

    // Deleted: gone, and a second delete is NOT_FOUND.
    c.delete_schedule(by_id("monday-report")).await.unwrap();
    assert_eq!(
        c.get_schedule(by_id("monday-report"))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    assert_eq!(
        c.delete_schedule(by_id("monday-report"))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
}

/// Runs the host-agent CLI against `addr` with `args`; its stdout, or a
/// panic with its stderr.
fn cli(addr: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .arg("--addr")
        .arg(addr)
        .args(args)
        .output()
        .expect("running the host-agent CLI");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_creates_lists_disables_and_deletes_schedules() {
    let agent = Agent::start(&[]);
    guest_init_image(&agent, "counter").await;
    let a = agent.addr.as_str();
    let made = cli(
        a,
        &[
            "schedules",
            "create",
            "--id",
            "nightly",
            "--cron",
            "0 2 * * *",
            "--timezone",
            "Asia/Tokyo",
            "--image",
            "counter",
            "--label",
            "team=ops",
            "--overlap",
            "queue",
            "--catch-up",
            "once",
            "--output",
            "json",
            "--",
            "make",
            "backup",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(made.trim()).unwrap();
    assert_eq!(v["schedule_id"], "nightly");
    assert_eq!(v["timezone"], "Asia/Tokyo");
    assert_eq!(v["run"], serde_json::json!(["make", "backup"]));
    assert_eq!(
        (v["overlap"].as_str(), v["catch_up"].as_str()),
        (Some("OVERLAP_QUEUE"), Some("CATCH_UP_ONCE"))
    );
    // 02:00 in Tokyo is 17:00 UTC.
    let next =
        chrono::DateTime::from_timestamp_millis(v["next_fire_at"].as_i64().unwrap()).unwrap();
    assert_eq!((next.hour(), next.minute()), (17, 0), "{next}");

    let table = cli(a, &["schedules", "list"]);
    assert!(table.starts_with("SCHEDULE"), "{table}");
    assert!(
        table.contains("nightly") && table.contains("Asia/Tokyo") && table.contains("make backup"),
        "{table}"
    );
    let off = cli(a, &["schedules", "disable", "nightly", "--output", "json"]);
    let off: serde_json::Value = serde_json::from_str(off.trim()).unwrap();
    assert_eq!(
        (off["enabled"].as_bool(), off["next_fire_at"].as_i64()),
        (Some(false), Some(0))
    );
    cli(a, &["schedules", "delete", "nightly"]);
    let gone = std::process::Command::new(env!("CARGO_BIN_EXE_host-agent"))
        .args(["--addr", a, "schedules", "get", "nightly"])
        .output()
        .unwrap();
    assert!(!gone.status.success());
    assert!(
        String::from_utf8_lossy(&gone.stderr).contains("not found"),
        "{gone:?}"
    );
}
