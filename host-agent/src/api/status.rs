//! How an [`Error`] reaches a gRPC client: its status code and message,
//! counted in `hostagent_api_errors_total`. Here rather than in `error.rs`,
//! so the error type depends on nothing else in the crate.

use tonic::Status;

use crate::error::Error;

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        crate::metrics::api_error(e.code());
        Status::new(e.code(), e.to_string())
    }
}
