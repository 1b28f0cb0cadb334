//! The error detail on every failed Tidepool RPC.
//!
//! Servers build their `tonic::Status` with [`status_with_detail`]; clients
//! read the stable code back with [`error_detail`]. The gRPC code that goes
//! with each [`ErrorCode`] is fixed here, in one place.
//!
//! On the wire (the gRPC richer error model, so any gRPC client reads it):
//! the status code and message, and in the `grpc-status-details-bin`
//! trailer a `google.rpc.Status` with the same code and message whose
//! `details` hold one `google.protobuf.Any` packing the
//! `tidepool.v1.ErrorDetail` (type URL [`ERROR_DETAIL_TYPE_URL`]). Nodes
//! before this form put the bare `ErrorDetail` bytes in that trailer, which
//! gRPC libraries that check the trailer (grpc-go, grpc-java) reject as a
//! mismatch; [`error_detail`] still reads that form, for a rolling
//! upgrade.

use prost::Message;
use tonic::{Code, Status};
use tonic_types::pb::Status as RpcStatus;

use crate::v1::{ErrorCode, ErrorDetail};

/// Type URL of a packed `tidepool.v1.ErrorDetail`.
pub const ERROR_DETAIL_TYPE_URL: &str = "type.googleapis.com/tidepool.v1.ErrorDetail";

/// An error detail together with the gRPC status code it travels under.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{}: {}", .detail.code().as_str_name(), .detail.message)]
pub struct ErrorInfo {
    /// The detail as sent on the wire.
    pub detail: ErrorDetail,
}

impl ErrorInfo {
    /// A detail with only a code and a message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            detail: ErrorDetail {
                code: code as i32,
                message: message.into(),
                ..ErrorDetail::default()
            },
        }
    }

    /// The stable code (`INTERNAL` for unknown or unspecified values).
    pub fn code(&self) -> ErrorCode {
        match self.detail.code() {
            ErrorCode::Unspecified => ErrorCode::Internal,
            code => code,
        }
    }

    /// The gRPC status code this error travels under.
    pub fn grpc_code(&self) -> Code {
        grpc_code(self.code())
    }
}

impl From<ErrorInfo> for Status {
    fn from(info: ErrorInfo) -> Status {
        status_with_detail(info.detail)
    }
}

/// The gRPC status code that accompanies each stable error code.
fn grpc_code(code: ErrorCode) -> Code {
    use ErrorCode as E;
    match code {
        E::InvalidArgument | E::DigestMismatch | E::ValueTooLarge | E::SizeMismatch => {
            Code::InvalidArgument
        }
        E::NotFound
        | E::NamespaceNotFound
        | E::NodeNotFound
        | E::ShardNotFound
        | E::SnapshotGone => Code::NotFound,
        E::NamespaceExists | E::AlreadyExists => Code::AlreadyExists,
        E::Unauthenticated => Code::Unauthenticated,
        E::PermissionDenied => Code::PermissionDenied,
        E::NotLeader | E::NoQuorum | E::ShuttingDown | E::NotCoordinatorLeader => Code::Unavailable,
        E::WrongShard | E::StaleMap | E::SessionExpired | E::WrongCluster => {
            Code::FailedPrecondition
        }
        E::Timeout => Code::DeadlineExceeded,
        E::DiskFull | E::Overloaded => Code::ResourceExhausted,
        E::Corrupt => Code::DataLoss,
        E::Conflict => Code::Aborted,
        E::Unsupported => Code::Unimplemented,
        E::Internal | E::Unspecified => Code::Internal,
    }
}

/// Builds a `tonic::Status` with the gRPC code that belongs to
/// `detail.code`, whose details are a `google.rpc.Status` (same code and
/// message) carrying `detail` packed as `google.protobuf.Any`.
pub fn status_with_detail(detail: ErrorDetail) -> Status {
    let code = grpc_code(detail.code());
    let message = format!("{}: {}", detail.code().as_str_name(), detail.message);
    let rpc = RpcStatus {
        code: code as i32,
        message: message.clone(),
        details: vec![prost_types::Any {
            type_url: ERROR_DETAIL_TYPE_URL.to_string(),
            value: detail.encode_to_vec(),
        }],
    };
    Status::with_details(code, message, rpc.encode_to_vec().into())
}

/// The form nodes used before [`status_with_detail`]: the bare
/// `ErrorDetail` bytes as the details. Kept to test that clients still
/// read it (a rolling upgrade); never sent.
#[doc(hidden)]
pub fn legacy_status_with_detail(detail: ErrorDetail) -> Status {
    let code = grpc_code(detail.code());
    let message = format!("{}: {}", detail.code().as_str_name(), detail.message);
    Status::with_details(code, message, detail.encode_to_vec().into())
}

/// Reads the Tidepool error detail from a status: from the
/// `google.rpc.Status` in its details, or — from a node of an older
/// version — the bare `ErrorDetail`. `None` when the status carries none
/// (for example a transport failure produced by the client's own gRPC
/// stack) or it does not decode.
pub fn error_detail(status: &Status) -> Option<ErrorDetail> {
    let bytes = status.details();
    if bytes.is_empty() {
        return None;
    }
    if let Ok(rpc) = RpcStatus::decode(bytes)
        && let Some(any) = rpc
            .details
            .iter()
            .find(|any| any.type_url == ERROR_DETAIL_TYPE_URL)
    {
        return ErrorDetail::decode(&any.value[..]).ok();
    }
    // The older form. (A google.rpc.Status carrying no ErrorDetail does
    // not decode as one with a code: its field 3 is not a varint.)
    ErrorDetail::decode(bytes)
        .ok()
        .filter(|d| d.code != ErrorCode::Unspecified as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detail_round_trips_through_status() {
        let mut info = ErrorInfo::new(ErrorCode::NotLeader, "shard 4 is led by node 2");
        info.detail.map_version = 17;
        info.detail.shard_id = Some(4);
        let status: Status = info.clone().into();
        assert_eq!(status.code(), Code::Unavailable);
        assert!(status.message().starts_with("NOT_LEADER: "));
        assert_eq!(error_detail(&status), Some(info.detail));
    }

    #[test]
    fn the_details_are_a_google_rpc_status_with_the_detail_packed_as_any() {
        let mut info = ErrorInfo::new(ErrorCode::NotFound, "no such blob");
        info.detail.map_version = 3;
        let status: Status = info.clone().into();
        let rpc = RpcStatus::decode(status.details()).expect("a google.rpc.Status");
        // What grpc-go and grpc-java check: the same code and message.
        assert_eq!(rpc.code, status.code() as i32);
        assert_eq!(rpc.message, status.message());
        assert_eq!(rpc.details.len(), 1);
        assert_eq!(rpc.details[0].type_url, ERROR_DETAIL_TYPE_URL);
        assert_eq!(
            ErrorDetail::decode(&rpc.details[0].value[..]).unwrap(),
            info.detail
        );
    }

    #[test]
    fn the_form_of_older_nodes_is_still_read() {
        for code in [
            ErrorCode::NotLeader,
            ErrorCode::NotFound,
            ErrorCode::Internal,
        ] {
            let mut info = ErrorInfo::new(code, "from an older node");
            info.detail.map_version = 9;
            info.detail.shard_id = Some(2);
            info.detail.leader_hint = Some(crate::v1::NodeAddress {
                node_id: 3,
                address: "http://10.0.0.3:7400".into(),
            });
            let status = legacy_status_with_detail(info.detail.clone());
            assert_eq!(error_detail(&status), Some(info.detail));
            // A bare detail with no map version or hint too.
            let bare = ErrorInfo::new(code, "x").detail;
            let status = legacy_status_with_detail(bare.clone());
            assert_eq!(error_detail(&status), Some(bare));
        }
    }

    #[test]
    fn a_rich_status_without_our_detail_has_none() {
        let rpc = RpcStatus {
            code: Code::NotFound as i32,
            message: "someone else's".into(),
            details: vec![prost_types::Any {
                type_url: "type.googleapis.com/google.rpc.DebugInfo".into(),
                value: vec![10, 1, b'x'],
            }],
        };
        let status =
            Status::with_details(Code::NotFound, "someone else's", rpc.encode_to_vec().into());
        assert_eq!(error_detail(&status), None);
    }

    #[test]
    fn status_without_detail_has_none() {
        assert_eq!(
            error_detail(&Status::unavailable("connection refused")),
            None
        );
    }

    #[test]
    fn every_code_has_a_stable_name_and_a_grpc_code() {
        // Walk the whole enum: a new code without a mapping fails to compile
        // in `grpc_code`; this checks the names stay SCREAMING_SNAKE.
        for value in 1..=28 {
            let code = ErrorCode::try_from(value).expect("contiguous codes");
            let name = code.as_str_name();
            assert!(
                name.chars().all(|c| c.is_ascii_uppercase() || c == '_'),
                "{name}"
            );
            assert_ne!(grpc_code(code), Code::Ok);
        }
        assert!(
            ErrorCode::try_from(29).is_err(),
            "update this test for new codes"
        );
    }

    #[test]
    fn unspecified_reads_as_internal() {
        let info = ErrorInfo {
            detail: ErrorDetail::default(),
        };
        assert_eq!(info.code(), ErrorCode::Internal);
    }
}
