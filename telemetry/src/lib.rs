//! Tidepool's observability plumbing, shared by every process (nodes,
//! coordinators, gateways):
//!
//! - [`metrics`]: the `/metrics`, `/healthz` and `/readyz` endpoint, a
//!   [`prometheus_client`] registry served by hyper with axum's router;
//! - [`requests`]: a tower layer counting every request by protocol, method
//!   and result code, with latency histograms;
//! - [`trace`]: the tracing subscriber (text or JSON log lines) and the
//!   OpenTelemetry trace export over OTLP/gRPC;
//! - [`sampling`]: the sampling decision, taken as a trace's first span in
//!   the process is made, so unsampled traces cost no OpenTelemetry work.
//!
//! The W3C trace context on the wire is `tidepool_security::trace_context`
//! (the SDK needs it too, and does not depend on this crate).
//!
//! ```no_run
//! use tidepool_telemetry::{LogFormat, TelemetryConfig};
//! let _guard = tidepool_telemetry::init(&TelemetryConfig {
//!     service_name: "tidepool-node".into(),
//!     log_format: LogFormat::Json,
//!     otlp_endpoint: Some("http://127.0.0.1:4317".into()),
//!     sampling_ratio: Some(0.05),
//!     default_filter: "info".into(),
//! })?;
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! Not here: what each process measures (its own crate registers its
//! metrics and collectors).

mod json;
pub mod metrics;
pub mod requests;
pub mod sampling;
pub mod trace;

pub use metrics::{Exposition, Format};
pub use requests::{MethodNames, RequestLayer, RequestMetrics};
pub use trace::{LogFormat, TelemetryConfig, TelemetryGuard, init, otlp_endpoint};
