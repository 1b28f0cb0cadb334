//! The error detail on every failed Tidepool RPC.
//!
//! Servers build their `tonic::Status` with [`status_with_detail`]; clients
//! read the stable code back with [`error_detail`]. The gRPC code that goes
//! with each [`ErrorCode`] is fixed here, in one place.

use prost::Message;
use tonic::{Code, Status};

use crate::v1::{ErrorCode, ErrorDetail};

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
        E::NamespaceExists => Code::AlreadyExists,
        E::NotLeader | E::NoQuorum | E::ShuttingDown | E::NotCoordinatorLeader => Code::Unavailable,
        E::WrongShard | E::StaleMap | E::SessionExpired => Code::FailedPrecondition,
        E::Timeout => Code::DeadlineExceeded,
        E::DiskFull | E::Overloaded => Code::ResourceExhausted,
        E::Corrupt => Code::DataLoss,
        E::Conflict => Code::Aborted,
        E::Unsupported => Code::Unimplemented,
        E::Internal | E::Unspecified => Code::Internal,
    }
}

/// Builds a `tonic::Status` carrying `detail` in its binary details, with the
/// gRPC code that belongs to `detail.code`.
pub fn status_with_detail(detail: ErrorDetail) -> Status {
    let code = grpc_code(detail.code());
    let message = format!("{}: {}", detail.code().as_str_name(), detail.message);
    Status::with_details(code, message, detail.encode_to_vec().into())
}

/// Reads the Tidepool error detail from a status. `None` when the status
/// carries none (for example a transport failure produced by the client's
/// own gRPC stack) or it does not decode.
pub fn error_detail(status: &Status) -> Option<ErrorDetail> {
    let bytes = status.details();
    if bytes.is_empty() {
        return None;
    }
    ErrorDetail::decode(bytes).ok()
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
        for value in 1..=24 {
            let code = ErrorCode::try_from(value).expect("contiguous codes");
            let name = code.as_str_name();
            assert!(
                name.chars().all(|c| c.is_ascii_uppercase() || c == '_'),
                "{name}"
            );
            assert_ne!(grpc_code(code), Code::Ok);
        }
        assert!(
            ErrorCode::try_from(25).is_err(),
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
