//! The process's tracing subscriber: logs (text or one JSON object per
//! line) and, when configured, `tracing` spans exported as OpenTelemetry
//! traces over OTLP/gRPC.
//!
//! Export is off by default. It is on when `--otlp-endpoint` is given or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT` is
//! set, unless `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. The
//! sampler is parent-based: a span whose caller sent a sampled
//! `traceparent` is sampled, a root span with probability
//! `--trace-sampling` (else `OTEL_TRACES_SAMPLER` / `_ARG` as the
//! OpenTelemetry specification defines them; default: every trace). The
//! decision is taken as a trace's first span in this process is made, and
//! the spans of unsampled traces never reach OpenTelemetry
//! ([`crate::sampling`]). `OTEL_SERVICE_NAME`,
//! `OTEL_RESOURCE_ATTRIBUTES` and `OTEL_BSP_*` are honoured by the SDK.
//!
//! Exporting never blocks a request: finished spans go to the batch
//! processor's bounded queue (dropped when it is full) and its own thread
//! exports them, with a bounded timeout, through a tonic channel driven by
//! a runtime of its own (one worker thread).

use std::io::IsTerminal as _;
use std::time::Duration;

use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider,
};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::{FilterExt as _, LevelFilter, Targets, filter_fn};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{Layer as _, Registry};

use crate::json::JsonLines;
use crate::sampling::{Rule, Sampling};

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (colours on a terminal).
    #[default]
    Text,
    /// One JSON object per line: timestamp, level, target, fields, the
    /// spans in scope, and the trace and span ids when the line is inside
    /// a trace.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!("unknown log format {s:?} (text or json)")),
        }
    }
}

/// What [`init`] sets up.
#[derive(Clone, Debug, Default)]
pub struct TelemetryConfig {
    /// `service.name` of exported spans (unless `OTEL_SERVICE_NAME` is set).
    pub service_name: String,
    /// Log line format.
    pub log_format: LogFormat,
    /// OTLP/gRPC collector, e.g. `http://127.0.0.1:4317` (overrides the
    /// environment).
    pub otlp_endpoint: Option<String>,
    /// Probability of sampling a trace this process starts (overrides
    /// `OTEL_TRACES_SAMPLER`); callers' decisions are always followed.
    pub sampling_ratio: Option<f64>,
    /// The log filter when `RUST_LOG` is unset.
    pub default_filter: String,
}

/// Keeps export running; flushes and stops it when dropped.
#[derive(Debug, Default)]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl TelemetryGuard {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some() && self.runtime.is_some()
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            let _ = provider.shutdown();
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// The collector endpoint in force: the flag, else the environment; `None`
/// when export is off.
pub fn otlp_endpoint(flag: Option<&str>) -> Option<String> {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"))
    {
        return None;
    }
    flag.map(str::to_string)
        .or_else(|| env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"))
}

/// How long one export may take before it is abandoned.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// Finished spans waiting for export; more are dropped.
const EXPORT_QUEUE: usize = 8_192;

fn provider(
    config: &TelemetryConfig,
    endpoint: Option<&str>,
    rule: Rule,
) -> anyhow::Result<TelemetryGuard> {
    let mut builder = SdkTracerProvider::builder();
    if !service_named_by_environment() {
        builder = builder.with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(config.service_name.clone())
                .build(),
        );
    }
    // Every span that reaches the SDK belongs to a trace the sampling
    // layer sampled (`crate::sampling`). Parent-based still, so that a
    // span given an unsampled caller's context afterwards (`set_parent`,
    // as an application does by hand) follows the caller.
    builder = builder.with_sampler(if rule.parent_based {
        Sampler::ParentBased(Box::new(Sampler::AlwaysOn))
    } else {
        Sampler::AlwaysOn
    });
    let mut runtime = None;
    if let Some(endpoint) = endpoint {
        // One worker thread of its own drives the channel's connection.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .thread_name("tidepool-otlp")
            .build()
            .context("cannot start the trace exporter's runtime")?;
        // The channel's worker is spawned on the runtime current while it
        // is built.
        let exporter = rt.block_on(async {
            opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .with_timeout(EXPORT_TIMEOUT)
                .build()
        });
        let exporter = exporter.with_context(|| format!("bad OTLP endpoint {endpoint:?}"))?;
        // The SDK reads `OTEL_BSP_*`; these defaults apply only where
        // the environment sets nothing (a value set in code wins over it).
        let unset = |name: &str| std::env::var_os(name).is_none();
        let mut config = BatchConfigBuilder::default();
        if unset("OTEL_BSP_MAX_QUEUE_SIZE") {
            config = config.with_max_queue_size(EXPORT_QUEUE);
        }
        if unset("OTEL_BSP_MAX_EXPORT_BATCH_SIZE") {
            config = config.with_max_export_batch_size(1_024);
        }
        if unset("OTEL_BSP_SCHEDULE_DELAY") {
            config = config.with_scheduled_delay(Duration::from_millis(500));
        }
        let batch = BatchSpanProcessor::builder(exporter)
            .with_batch_config(config.build())
            .build();
        builder = builder.with_span_processor(batch);
        runtime = Some(rt);
    }
    Ok(TelemetryGuard {
        provider: Some(builder.build()),
        runtime,
    })
}

/// Whether the environment names the service (`OTEL_SERVICE_NAME`, or
/// `service.name` in `OTEL_RESOURCE_ATTRIBUTES`): the process's own name
/// is then not set over it.
fn service_named_by_environment() -> bool {
    std::env::var_os("OTEL_SERVICE_NAME").is_some()
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|attributes| {
            attributes
                .split(',')
                .any(|pair| pair.split('=').next().map(str::trim) == Some("service.name"))
        })
}

/// Spans that only scope log lines (their fields go on every line logged
/// inside them) and are no part of a trace: the shard owner's, entered and
/// left on every round of its loop and open for the replica's whole life.
/// As OpenTelemetry spans they cost every round an enter and an exit with
/// a clock read, gave every line the owner logs the trace id of a trace
/// that is one span long, and were exported when their replica closed.
const LOG_SCOPES: &[&str] = &["shard"];

/// The spans made for every request: the node's `request` and the SDK's
/// operations (`tidepool.put`, ...). Logs at INFO or less log almost
/// nothing inside them (a rare warning, then without the request's
/// fields), yet a text logs layer formatted their fields on every request
/// and the registry kept them: up to a sixth of a small get's CPU
/// (`benchmarks/RESULTS.md`, issue 36). So with text logs at INFO or less
/// and nothing exported they are not made; JSON logs (whose lines carry
/// the trace ids of requests), an exporting process and a filter at DEBUG
/// or more (the access log lines of `tidepool_node::server::blobs`) keep
/// them.
fn per_request(metadata: &tracing::Metadata<'_>) -> bool {
    metadata.is_span()
        && ((metadata.name() == "request" && metadata.target().starts_with("tidepool_node"))
            || metadata.name().starts_with("tidepool."))
}

/// Whether `filter` lets any DEBUG line through (or cannot say).
fn debug_logs(filter: &EnvFilter) -> bool {
    <EnvFilter as tracing_subscriber::layer::Filter<Registry>>::max_level_hint(filter)
        .is_none_or(|level| level >= LevelFilter::DEBUG)
}

/// Only our own spans become OpenTelemetry spans (not those of the
/// libraries underneath), and not the [`LOG_SCOPES`].
fn traced(metadata: &tracing::Metadata<'_>) -> bool {
    !(metadata.is_span() && LOG_SCOPES.contains(&metadata.name()))
}

/// The logs layer: lines as `format` says, filtered by `filter`; text
/// logs see the [`per_request`] spans only if `request_spans`.
fn logs_layer(
    format: LogFormat,
    filter: EnvFilter,
    request_spans: bool,
) -> Box<dyn tracing_subscriber::Layer<Registry> + Send + Sync> {
    match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .with_filter(
                filter.and(
                    filter_fn(move |metadata| request_spans || !per_request(metadata))
                        .with_max_level_hint(LevelFilter::TRACE),
                ),
            )
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .event_format(JsonLines)
            .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    }
}

/// Installs the global subscriber; keep the guard for the process's life.
///
/// OpenTelemetry contexts are kept when spans are exported or when logs
/// are JSON (so log lines carry the trace ids of requests that came with a
/// `traceparent`, exported or not).
pub fn init(config: &TelemetryConfig) -> anyhow::Result<TelemetryGuard> {
    let endpoint = otlp_endpoint(config.otlp_endpoint.as_deref());
    let with_contexts = endpoint.is_some() || config.log_format == LogFormat::Json;
    let rule = Rule::new(config.sampling_ratio)?;
    let guard = if with_contexts {
        provider(config, endpoint.as_deref(), rule)?
    } else {
        TelemetryGuard::default()
    };
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(&config.default_filter));
    // Text logs at INFO or less with nothing exported: the spans made for
    // every request are not made for the logs ([`per_request`]).
    let request_spans = with_contexts || debug_logs(&filter);
    let logs = logs_layer(config.log_format, filter, request_spans);
    let otel = guard.provider.as_ref().map(|provider| {
        let tracer = provider.tracer("tidepool");
        // Targets match by prefix: every `tidepool*` crate, at INFO. Both
        // filters state their level, so the process's `tracing` level stays
        // what the filters need (a filter without a hint makes it TRACE).
        let ours = Targets::new().with_target("tidepool", tracing::Level::INFO);
        let spans = filter_fn(traced).with_max_level_hint(LevelFilter::INFO);
        let layer = tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_level(false)
            // Nothing reads OpenTelemetry's current context (contexts are
            // taken from the `tracing` span at hand: `trace_context`), and
            // a span's duration is what a trace shows: no context switched
            // in and out, no busy/idle clock reads, on every poll of an
            // instrumented future.
            .with_context_activation(false)
            .with_tracked_inactivity(false);
        // Sampling decided as a trace's first span here is made: the
        // OpenTelemetry layer sees sampled traces only.
        Sampling::new(layer, rule).with_filter(ours.and(spans))
    });
    Registry::default()
        .with(logs)
        .with(otel)
        .try_init()
        .context("a tracing subscriber is already installed")?;
    if guard.exporting() {
        tidepool_security::trace_context::set_exporting(true);
    }
    if with_contexts {
        tidepool_security::trace_context::set_tracking(true);
    }
    Ok(guard)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether a text logs layer on `filter` (as `init` sets it up with
    /// nothing exported) lets through a request span, a shard owner's span
    /// and an SDK operation's span. The predicates are asked directly:
    /// spans made under scoped subscribers in parallel tests share the
    /// process's callsite cache, so whether one was made says little.
    fn logged(filter: &str) -> [bool; 3] {
        let filter = EnvFilter::new(filter);
        let request_spans = debug_logs(&filter);
        let spans = [
            tracing::info_span!(target: "tidepool_node::server::blobs", "request"),
            tracing::info_span!(target: "tidepool_node::shard", "shard"),
            tracing::info_span!(target: "tidepool_client::client", "tidepool.put"),
        ];
        spans.map(|span| {
            let metadata = span
                .metadata()
                .expect("a span made by a macro has metadata");
            request_spans || !per_request(metadata)
        })
    }

    #[test]
    fn text_logs_at_info_make_no_span_per_request() {
        assert_eq!(logged("info"), [false, true, false]);
        assert_eq!(logged("warn"), [false, true, false]);
    }

    #[test]
    fn text_logs_at_debug_anywhere_keep_the_request_spans() {
        assert_eq!(
            logged("info,tidepool_node::server::blobs=debug"),
            [true, true, true]
        );
        assert_eq!(logged("debug"), [true, true, true]);
    }
}
