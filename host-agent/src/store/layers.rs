//! The snapshot layer tables: each layer's row, and who holds it.

use rusqlite::{params, OptionalExtension, Row};

use super::Store;
use crate::error::Result;

/// One snapshot layer as recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerRow {
    /// Layer id (a directory name under the layer store, or the id given to
    /// an image's golden snapshot).
    pub id: String,
    /// The layer it is a diff over (empty: a full snapshot).
    pub parent: String,
    /// `golden`, `pause`, `fork` or `snapshot`.
    pub kind: String,
    /// Its directory on the node.
    pub dir: String,
    /// Bytes it takes on disk.
    pub bytes: u64,
    /// Unix ms.
    pub created_at: i64,
    /// The session whose vmm wrote it (empty for a golden snapshot).
    pub owner_session: String,
}

fn layer_from_row(r: &Row<'_>) -> rusqlite::Result<LayerRow> {
    Ok(LayerRow {
        id: r.get(0)?,
        parent: r.get(1)?,
        kind: r.get(2)?,
        dir: r.get(3)?,
        bytes: r.get::<_, i64>(4)? as u64,
        created_at: r.get(5)?,
        owner_session: r.get(6)?,
    })
}

const COLUMNS: &str = "id, parent, kind, dir, bytes, created_at, owner_session";

impl Store {
    /// Records `layer` held by each of `holders`, and, in the same
    /// transaction, moves each `(holder, old)` of `release` off `old`.
    pub fn insert_layer(
        &self,
        layer: &LayerRow,
        holders: &[&str],
        release: &[(&str, &str)],
    ) -> Result<()> {
        self.with(|c| {
            let tx = c.transaction()?;
            tx.execute(
                &format!("INSERT INTO layers({COLUMNS}) VALUES(?1,?2,?3,?4,?5,?6,?7)"),
                params![
                    layer.id,
                    layer.parent,
                    layer.kind,
                    layer.dir,
                    layer.bytes as i64,
                    layer.created_at,
                    layer.owner_session
                ],
            )?;
            for h in holders {
                tx.execute(
                    "INSERT OR IGNORE INTO layer_holds(layer, holder) VALUES(?1, ?2)",
                    params![layer.id, h],
                )?;
            }
            for (holder, old) in release {
                tx.execute(
                    "DELETE FROM layer_holds WHERE layer = ?1 AND holder = ?2",
                    params![old, holder],
                )?;
            }
            tx.commit()
        })
    }

    /// The layer `id`.
    pub fn layer(&self, id: &str) -> Result<Option<LayerRow>> {
        self.with(|c| {
            c.query_row(
                &format!("SELECT {COLUMNS} FROM layers WHERE id = ?1"),
                [id],
                layer_from_row,
            )
            .optional()
        })
    }

    /// The layer recorded for directory `dir` (an image's golden snapshot).
    pub fn layer_by_dir(&self, dir: &str) -> Result<Option<LayerRow>> {
        self.with(|c| {
            c.query_row(
                &format!("SELECT {COLUMNS} FROM layers WHERE dir = ?1"),
                [dir],
                layer_from_row,
            )
            .optional()
        })
    }

    /// Every layer, oldest first.
    pub fn layers(&self) -> Result<Vec<LayerRow>> {
        self.with(|c| {
            let mut st = c.prepare(&format!(
                "SELECT {COLUMNS} FROM layers ORDER BY created_at, id"
            ))?;
            let rows = st.query_map([], layer_from_row)?;
            rows.collect()
        })
    }

    /// Every (layer, holder) pair.
    pub fn layer_holds(&self) -> Result<Vec<(String, String)>> {
        self.with(|c| {
            let mut st =
                c.prepare("SELECT layer, holder FROM layer_holds ORDER BY layer, holder")?;
            let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect()
        })
    }

    /// The layers `holder` holds.
    pub fn held_by(&self, holder: &str) -> Result<Vec<String>> {
        self.with(|c| {
            let mut st =
                c.prepare("SELECT layer FROM layer_holds WHERE holder = ?1 ORDER BY layer")?;
            let rows = st.query_map([holder], |r| r.get(0))?;
            rows.collect()
        })
    }

    /// `holder` holds `layer` (again: no change).
    pub fn hold_layer(&self, layer: &str, holder: &str) -> Result<()> {
        self.with(|c| {
            c.execute(
                "INSERT OR IGNORE INTO layer_holds(layer, holder) VALUES(?1, ?2)",
                params![layer, holder],
            )
            .map(|_| ())
        })
    }

    /// `holder` lets go of `layer`, or of every layer with `layer` `None`.
    pub fn release_layer(&self, layer: Option<&str>, holder: &str) -> Result<()> {
        self.with(|c| {
            match layer {
                Some(l) => c.execute(
                    "DELETE FROM layer_holds WHERE layer = ?1 AND holder = ?2",
                    params![l, holder],
                )?,
                None => c.execute("DELETE FROM layer_holds WHERE holder = ?1", [holder])?,
            };
            Ok(())
        })
    }

    /// Layers nothing holds and no layer descends from.
    pub fn unheld_leaves(&self) -> Result<Vec<LayerRow>> {
        self.with(|c| {
            let mut st = c.prepare(&format!(
                "SELECT {COLUMNS} FROM layers l WHERE \
                 NOT EXISTS (SELECT 1 FROM layer_holds h WHERE h.layer = l.id) AND \
                 NOT EXISTS (SELECT 1 FROM layers k WHERE k.parent = l.id) \
                 ORDER BY created_at, id"
            ))?;
            let rows = st.query_map([], layer_from_row)?;
            rows.collect()
        })
    }

    /// Records layer `id`'s size.
    pub fn set_layer_bytes(&self, id: &str, bytes: u64) -> Result<()> {
        self.with(|c| {
            c.execute(
                "UPDATE layers SET bytes = ?2 WHERE id = ?1",
                params![id, bytes as i64],
            )
            .map(|_| ())
        })
    }

    /// Removes layer `id`'s row and holds.
    pub fn delete_layer(&self, id: &str) -> Result<()> {
        self.with(|c| {
            let tx = c.transaction()?;
            tx.execute("DELETE FROM layer_holds WHERE layer = ?1", [id])?;
            tx.execute("DELETE FROM layers WHERE id = ?1", [id])?;
            tx.commit()
        })
    }

    /// Bytes of the layers sessions' vmms wrote (everything but golden
    /// snapshots), in all, or those `session`'s vmm wrote.
    pub fn snapshot_bytes(&self, session: Option<&str>) -> Result<u64> {
        self.with(|c| {
            let n: i64 = match session {
                Some(s) => c.query_row(
                    "SELECT COALESCE(SUM(bytes), 0) FROM layers WHERE owner_session = ?1",
                    [s],
                    |r| r.get(0),
                )?,
                None => c.query_row(
                    "SELECT COALESCE(SUM(bytes), 0) FROM layers WHERE kind <> 'golden'",
                    [],
                    |r| r.get(0),
                )?,
            };
            Ok(n.max(0) as u64)
        })
    }
}
