//! The protocols the test kit speaks: the coordinator's (re-exported) and the harness's fenced
//! store (`proto/harness.proto`), which a nemesis run serves to its worker processes.

pub use tenure_coordinator::proto::*;

/// The harness's fenced store: test kit only.
pub mod harness {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("tenure.harness.v1");
}
