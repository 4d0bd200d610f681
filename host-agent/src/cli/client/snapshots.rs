//! `host-agent snapshots list|gc`: the node's snapshot layers (golden
//! snapshots and the diffs written over them), through the Snapshots
//! service (admin scope).

use clap::Subcommand;
use proto::hostagent as pb;
use proto::hostagent::snapshots_client::SnapshotsClient;
use serde_json::{json, Value};
use tonic::transport::Channel;

use super::{status as st, Bearer};
use crate::cli::output::{print_all, Output, Record};

/// The `snapshots` subcommands.
#[derive(Subcommand)]
pub enum SnapshotsCmd {
    /// List every layer, parents before their children.
    List,
    /// Delete the layers nothing holds (host-agent also does this whenever
    /// a holder lets go); prints what was deleted and the bytes freed.
    Gc {
        /// Only print what would be deleted.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Runs `snapshots <cmd>`.
pub async fn run(ch: Channel, bearer: Bearer, out: Output, c: SnapshotsCmd) -> Result<(), String> {
    let mut cl = SnapshotsClient::with_interceptor(ch, bearer);
    match c {
        SnapshotsCmd::List => {
            let layers = cl
                .list_layers(pb::ListLayersRequest {})
                .await
                .map_err(st)?
                .into_inner()
                .layers;
            print_all(&layers, out);
        }
        SnapshotsCmd::Gc { dry_run } => {
            let r = cl
                .collect_garbage(pb::CollectGarbageRequest { dry_run })
                .await
                .map_err(st)?
                .into_inner();
            print!("{}", gc_text(&r, dry_run, out));
        }
    }
    Ok(())
}

/// What `snapshots gc` prints: the deleted layers (a table, or one JSON
/// object each), then a summary line (or `{"bytes_freed", "dry_run"}`).
fn gc_text(r: &pb::CollectGarbageResponse, dry_run: bool, out: Output) -> String {
    match out {
        Output::Table => {
            let mut text = String::new();
            if !r.deleted.is_empty() {
                let rows: Vec<Vec<String>> = r.deleted.iter().map(Record::cells).collect();
                text.push_str(&crate::cli::output::table(pb::Layer::headers(), &rows));
            }
            let verb = if dry_run { "would delete" } else { "deleted" };
            let freed = if dry_run { "would free" } else { "freed" };
            text.push_str(&format!(
                "{verb} {} layer{}, {freed} {}\n",
                r.deleted.len(),
                if r.deleted.len() == 1 { "" } else { "s" },
                human_bytes(r.bytes_freed)
            ));
            text
        }
        Output::Json => {
            let mut text = String::new();
            for l in &r.deleted {
                text.push_str(&format!("{}\n", l.json()));
            }
            text.push_str(&format!(
                "{}\n",
                json!({"bytes_freed": r.bytes_freed, "dry_run": dry_run})
            ));
            text
        }
    }
}

impl Record for pb::Layer {
    fn headers() -> &'static [&'static str] {
        &[
            "LAYER", "KIND", "PARENT", "SIZE", "HOLDERS", "CHILDREN", "CREATED",
        ]
    }
    fn cells(&self) -> Vec<String> {
        vec![
            self.layer_id.clone(),
            self.kind.clone(),
            dash(&self.parent_id),
            human_bytes(self.bytes),
            dash(&self.holders.join(",")),
            self.children.to_string(),
            utc(self.created_at),
        ]
    }
    fn json(&self) -> Value {
        json!({
            "layer_id": self.layer_id,
            "parent_id": self.parent_id,
            "kind": self.kind,
            "bytes": self.bytes,
            "created_at": self.created_at,
            "holders": self.holders,
            "children": self.children,
            "dir": self.dir,
        })
    }
}

fn dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s.to_string()
    }
}

/// `n` bytes for people: `512 B`, `4.0 KiB`, `1.5 MiB`, `2.0 GiB`.
fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// Unix milliseconds as a UTC time to the second, `2024-02-29T12:00:00Z`
/// (`-` for 0, a time never set).
pub(super) fn utc(ms: i64) -> String {
    if ms == 0 {
        return "-".into();
    }
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The proleptic Gregorian date of day `z` after 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn golden() -> pb::Layer {
        pb::Layer {
            layer_id: "g-1".into(),
            parent_id: String::new(),
            kind: "golden".into(),
            bytes: 3 << 20,
            created_at: 951_825_600_000,
            holders: vec!["image:count".into()],
            children: 1,
            dir: "/state/images/count/golden".into(),
        }
    }

    fn pause() -> pb::Layer {
        pb::Layer {
            layer_id: "p-2".into(),
            parent_id: "g-1".into(),
            kind: "pause".into(),
            bytes: 12_288,
            created_at: 951_825_601_500,
            holders: vec!["session:s1".into(), "snapshots:s1".into()],
            children: 0,
            dir: "/state/layers/p-2".into(),
        }
    }

    #[test]
    fn sizes_and_times_read_as_people_write_them() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1024), "1.0 KiB");
        assert_eq!(human_bytes(3 << 19), "1.5 MiB");
        assert_eq!(human_bytes(5 << 30), "5.0 GiB");
        assert_eq!(utc(0), "-");
        assert_eq!(utc(1), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_825_600_000), "2000-02-29T12:00:00Z");
        assert_eq!(utc(1_735_689_599_999), "2024-12-31T23:59:59Z");
    }

    #[test]
    fn layers_list_as_a_table_with_every_field_in_json() {
        let rows: Vec<Vec<String>> = [golden(), pause()].iter().map(Record::cells).collect();
        assert_eq!(
            crate::cli::output::table(pb::Layer::headers(), &rows),
            "LAYER  KIND    PARENT  SIZE      HOLDERS                  CHILDREN  CREATED\n\
             g-1    golden  -       3.0 MiB   image:count              1         2000-02-29T12:00:00Z\n\
             p-2    pause   g-1     12.0 KiB  session:s1,snapshots:s1  0         2000-02-29T12:00:01Z\n"
        );
        let j = pause().json();
        assert_eq!(j["parent_id"], "g-1");
        assert_eq!(j["holders"][1], "snapshots:s1");
        assert_eq!(j["bytes"], 12_288);
        assert_eq!(j["dir"], "/state/layers/p-2");
    }

    #[test]
    fn gc_prints_what_went_and_the_bytes_freed() {
        let r = pb::CollectGarbageResponse {
            deleted: vec![pause()],
            bytes_freed: 12_288,
        };
        let t = gc_text(&r, false, Output::Table);
        assert!(t.starts_with("LAYER  KIND"), "{t}");
        assert!(t.ends_with("deleted 1 layer, freed 12.0 KiB\n"), "{t}");
        assert_eq!(
            gc_text(&Default::default(), true, Output::Table),
            "would delete 0 layers, would free 0 B\n"
        );
        let j = gc_text(&r, true, Output::Json);
        let lines: Vec<Value> = j
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["layer_id"], "p-2");
        assert_eq!(lines[1], json!({"bytes_freed": 12_288, "dry_run": true}));
    }
}
