//! `hostagent.v1.Events`: Watch(since_seq, session_id, labels).

use std::pin::Pin;
use std::sync::Arc;

use proto::hostagent as pb;
use proto::hostagent::events_server::Events;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use super::{check_session_id, event_pb};
use crate::api::listing::check_labels;
use crate::auth::layer::caller_of;
use crate::sessions::Manager;
use crate::store::{EventFilter, EVENT_SCHEDULE, EVENT_SESSION};

/// The kinds a watch may ask for: each one of the event kinds, at most once.
fn check_kinds(kinds: Vec<String>) -> Result<Vec<String>, Status> {
    for k in &kinds {
        if k != EVENT_SESSION && k != EVENT_SCHEDULE {
            return Err(crate::error::Error::invalid(format!(
                "kinds: {k:?} is not an event kind ({EVENT_SESSION:?} or {EVENT_SCHEDULE:?})"
            ))
            .into());
        }
    }
    Ok(kinds)
}

/// The Events service.
pub struct EventsApi(pub Arc<Manager>);

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::Event, Status>> + Send>>;

#[tonic::async_trait]
impl Events for EventsApi {
    type WatchStream = EventStream;

    async fn watch(
        &self,
        req: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let caller = caller_of(&req)?;
        let r = req.into_inner();
        let session = if r.session_id.is_empty() {
            None
        } else {
            check_session_id(&r.session_id)?;
            Some(r.session_id)
        };
        let filter = EventFilter {
            session,
            owner: caller.owner_filter().map(str::to_string),
            labels: check_labels("labels", &r.labels)?,
            kinds: check_kinds(r.kinds)?,
        };
        let rx = self
            .0
            .events
            .watch(self.0.store.clone(), r.since_seq, filter);
        // In a fleet, each event names its node (as the export does).
        let node = self
            .0
            .fleet
            .get()
            .filter(|f| f.js.is_some())
            .map(|f| f.node.clone())
            .unwrap_or_default();
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx).map(move |item| {
            item.map(|e| pb::Event {
                node: node.clone(),
                ..event_pb(&e)
            })
            .map_err(Status::from)
        });
        Ok(Response::new(Box::pin(stream)))
    }
}
