//! The SDK's error: a stable code (the wire contract's `ErrorCode`) and a
//! message, or a local I/O failure of a streamed transfer.

use tidepool_proto::error_detail;
use tidepool_proto::v1::ErrorCode;

/// What went wrong. Match on [`Error::code`]; messages are for people.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The cluster refused the call, or the SDK detected the condition the
    /// code names (for example `CORRUPT` when content fails verification,
    /// `TIMEOUT` when the deadline passed while retrying).
    #[error("{message} [{}]", code.as_str_name())]
    Api {
        /// The stable code.
        code: ErrorCode,
        /// What happened.
        message: String,
    },
    /// Reading the input or writing the output of a streamed transfer
    /// failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// Results of the SDK.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An error with a code.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Error::Api {
            code,
            message: message.into(),
        }
    }

    /// The stable code (`INTERNAL` for local I/O failures).
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::Api { code, .. } => *code,
            Error::Io(_) => ErrorCode::Internal,
        }
    }

    /// Whether the key, namespace or node does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(
            self.code(),
            ErrorCode::NotFound | ErrorCode::NamespaceNotFound | ErrorCode::NodeNotFound
        )
    }
}

/// Records a failed call's code as `error_code` on the current span (the
/// SDK call's own, which declares the field).
pub(crate) trait Traced {
    fn traced(self) -> Self;
}

impl<T> Traced for Result<T> {
    fn traced(self) -> Self {
        if let Err(error) = &self {
            tracing::Span::current().record("error_code", error.code().as_str_name());
        }
        self
    }
}

/// What a failed call means for the retry loop.
pub(crate) enum Disposition {
    /// Final: give it to the caller.
    Fail(Error),
    /// Try the node this one named as leader (by address, and id), at
    /// once. The flag: no leader is to be had there for now — none was
    /// named, or the follower has not heard from the one it names for a
    /// while (`leader_silent_ms`) — so an election is under way or due.
    Redirect(Error, Option<String>, Option<u64>, bool),
    /// The map is stale: refresh it, then try again.
    Refresh(Error),
    /// Transient: wait a little and try (another replica).
    Backoff(Error),
}

/// Classifies a failed call.
pub(crate) fn classify(status: &tonic::Status) -> Disposition {
    let detail = error_detail(status);
    if detail.is_none()
        && let Some(code) = final_without_detail(status.code())
    {
        return Disposition::Fail(Error::new(code, status.message().to_string()));
    }
    // A detail whose code this SDK does not know (a newer node's, in a
    // rolling upgrade) or none (`ERROR_CODE_UNSPECIFIED`): the node's
    // answer, final, and `INTERNAL` as the contract says — retried until
    // the deadline, it became a TIMEOUT with the node's code lost.
    if let Some(d) = &detail
        && !ErrorCode::try_from(d.code).is_ok_and(|c| c != ErrorCode::Unspecified)
    {
        return Disposition::Fail(Error::new(
            ErrorCode::Internal,
            format!(
                "the node answered with error code {} (unknown to this SDK): {}",
                d.code,
                status.message()
            ),
        ));
    }
    let code = detail
        .as_ref()
        .and_then(|d| ErrorCode::try_from(d.code).ok())
        .unwrap_or(ErrorCode::Unspecified);
    let error = Error::new(
        if code == ErrorCode::Unspecified {
            ErrorCode::Timeout
        } else {
            code
        },
        status.message().to_string(),
    );
    match code {
        ErrorCode::NotLeader => {
            let silent = detail
                .as_ref()
                .is_some_and(|d| d.leader_silent_ms.is_some());
            let hint = detail.and_then(|d| d.leader_hint);
            let address = hint
                .as_ref()
                .map(|h| h.address.clone())
                .filter(|a| !a.is_empty());
            let electing = address.is_none() || silent;
            Disposition::Redirect(error, address, hint.map(|h| h.node_id), electing)
        }
        ErrorCode::WrongShard | ErrorCode::StaleMap | ErrorCode::ShardNotFound => {
            Disposition::Refresh(error)
        }
        ErrorCode::NoQuorum
        | ErrorCode::ShuttingDown
        | ErrorCode::Overloaded
        | ErrorCode::Timeout
        | ErrorCode::NotCoordinatorLeader
        | ErrorCode::Unspecified => Disposition::Backoff(error),
        _ => Disposition::Fail(error),
    }
}

/// The stable code of a status that carries no Tidepool detail but whose
/// gRPC code says trying again cannot help: the gRPC layer refused the
/// request (too large for the server: `OUT_OF_RANGE`), a server that does
/// not know the method (`UNIMPLEMENTED`: an older version), or something in
/// between refused the credential (a proxy's 401 or 403). Every other
/// status without a detail is the transport's, retried until the
/// deadline.
fn final_without_detail(code: tonic::Code) -> Option<ErrorCode> {
    match code {
        tonic::Code::InvalidArgument | tonic::Code::OutOfRange => Some(ErrorCode::InvalidArgument),
        tonic::Code::Unimplemented => Some(ErrorCode::Unsupported),
        tonic::Code::Unauthenticated => Some(ErrorCode::Unauthenticated),
        tonic::Code::PermissionDenied => Some(ErrorCode::PermissionDenied),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidepool_proto::v1::{ErrorDetail, NodeAddress};
    use tidepool_proto::{legacy_status_with_detail, status_with_detail};

    fn not_leader() -> ErrorDetail {
        ErrorDetail {
            code: ErrorCode::NotLeader as i32,
            message: "node 1 does not lead shard 2; node 3 does".into(),
            map_version: 7,
            leader_hint: Some(NodeAddress {
                node_id: 3,
                address: "http://10.0.0.3:7400".into(),
            }),
            ..ErrorDetail::default()
        }
    }

    /// A rolling upgrade: the SDK follows the hint of a node that sends
    /// the current form and of one that sends the form before it.
    #[test]
    fn a_not_leader_hint_is_followed_in_both_wire_forms() {
        for status in [
            status_with_detail(not_leader()),
            legacy_status_with_detail(not_leader()),
        ] {
            match classify(&status) {
                Disposition::Redirect(error, address, id, electing) => {
                    assert_eq!(error.code(), ErrorCode::NotLeader);
                    assert_eq!(address.as_deref(), Some("http://10.0.0.3:7400"));
                    assert_eq!(id, Some(3));
                    assert!(!electing, "the named leader is heard from");
                }
                _ => panic!("not a redirect: {status:?}"),
            }
        }
    }

    /// A follower that no longer hears the leader it names, or names none,
    /// tells of an election: the retry loop then polls the replicas instead
    /// of pacing its attempts by the hedge delay.
    #[test]
    fn a_silent_or_unknown_leader_means_an_election() {
        let silent = ErrorDetail {
            leader_silent_ms: Some(600),
            ..not_leader()
        };
        let unknown = ErrorDetail {
            leader_hint: None,
            ..not_leader()
        };
        for (detail, address) in [(silent, Some("http://10.0.0.3:7400")), (unknown, None)] {
            match classify(&status_with_detail(detail)) {
                Disposition::Redirect(_, hinted, _, electing) => {
                    assert_eq!(hinted.as_deref(), address);
                    assert!(electing);
                }
                _ => panic!("not a redirect"),
            }
        }
    }

    /// A status without Tidepool's detail: final when its gRPC code says
    /// a repeat cannot help, retried otherwise.
    #[test]
    fn a_status_without_a_detail_is_final_only_when_a_retry_cannot_help() {
        use tonic::Code;
        for (code, stable) in [
            (Code::OutOfRange, ErrorCode::InvalidArgument),
            (Code::InvalidArgument, ErrorCode::InvalidArgument),
            (Code::Unimplemented, ErrorCode::Unsupported),
            (Code::Unauthenticated, ErrorCode::Unauthenticated),
            (Code::PermissionDenied, ErrorCode::PermissionDenied),
        ] {
            match classify(&tonic::Status::new(code, "refused")) {
                Disposition::Fail(error) => assert_eq!(error.code(), stable, "{code:?}"),
                _ => panic!("{code:?} is retried"),
            }
        }
        for code in [
            Code::Unavailable,
            Code::Unknown,
            Code::Cancelled,
            Code::DeadlineExceeded,
            Code::Internal,
        ] {
            assert!(
                matches!(
                    classify(&tonic::Status::new(code, "transport")),
                    Disposition::Backoff(_)
                ),
                "{code:?} is retried"
            );
        }
    }

    /// A node's detail with a code this SDK does not know (a newer node's)
    /// or with none is the node's final answer, `INTERNAL`, with the code
    /// in the message — not retried until the deadline as a transport
    /// failure.
    #[test]
    fn an_unknown_or_unspecified_code_is_final_and_internal() {
        for code in [0, 9_999] {
            let detail = ErrorDetail {
                code,
                message: "something new".into(),
                ..ErrorDetail::default()
            };
            match classify(&status_with_detail(detail)) {
                Disposition::Fail(error) => {
                    assert_eq!(error.code(), ErrorCode::Internal, "code {code}");
                    assert!(error.to_string().contains(&code.to_string()), "{error}");
                }
                _ => panic!("code {code} is retried"),
            }
        }
    }

    #[test]
    fn a_final_error_keeps_its_stable_code_in_both_wire_forms() {
        let detail = ErrorDetail {
            code: ErrorCode::NamespaceNotFound as i32,
            message: "no namespace \"x\"".into(),
            ..ErrorDetail::default()
        };
        for status in [
            status_with_detail(detail.clone()),
            legacy_status_with_detail(detail.clone()),
        ] {
            match classify(&status) {
                Disposition::Fail(error) => {
                    assert_eq!(error.code(), ErrorCode::NamespaceNotFound)
                }
                _ => panic!("not final: {status:?}"),
            }
        }
    }
}
