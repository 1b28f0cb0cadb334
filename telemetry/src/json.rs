//! `--log-format json`: one JSON object per line, with the trace and span
//! ids of the OpenTelemetry span the line was logged in.
//!
//! ```json
//! {"timestamp":"2026-11-27T07:00:00.000000Z","level":"INFO","target":"tidepool_node::shard",
//!  "fields":{"message":"leadership changed","term":3},
//!  "spans":[{"name":"shard","node_id":1,"shard_id":0}],
//!  "trace_id":"4bf92f3577b34da6a3ce929d0e0e4736","span_id":"00f067aa0ba902b7"}
//! ```

use opentelemetry::trace::TraceContextExt as _;
use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime as _, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// The JSON line formatter.
#[derive(Clone, Copy, Debug, Default)]
pub struct JsonLines;

/// Collects an event's fields into a JSON object.
struct Fields(Map<String, Value>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().into(), Value::String(format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }
}

/// The trace and span ids of the span `id`, if it belongs to a trace.
fn trace_ids(id: &tracing::span::Id) -> Option<(String, String)> {
    let context = tracing::dispatcher::get_default(|dispatch| {
        tracing_opentelemetry::get_otel_context(id, dispatch)
    })?;
    let span = context.span();
    let span_context = span.span_context();
    span_context.is_valid().then(|| {
        (
            span_context.trace_id().to_string(),
            span_context.span_id().to_string(),
        )
    })
}

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let mut line = Map::new();
        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        line.insert("timestamp".into(), timestamp.into());
        let metadata = event.metadata();
        line.insert("level".into(), metadata.level().as_str().into());
        line.insert("target".into(), metadata.target().into());
        let mut fields = Fields(Map::new());
        event.record(&mut fields);
        line.insert("fields".into(), Value::Object(fields.0));
        // The ids first: looking them up takes the span's extensions.
        let leaf = ctx
            .event_scope()
            .and_then(|mut scope| scope.next().map(|s| s.id()));
        if tidepool_security::trace_context::tracking()
            && let Some((trace_id, span_id)) = leaf.as_ref().and_then(trace_ids)
        {
            line.insert("trace_id".into(), trace_id.into());
            line.insert("span_id".into(), span_id.into());
        }
        if let Some(scope) = ctx.event_scope() {
            let mut spans = Vec::new();
            for span in scope.from_root() {
                let mut object = Map::new();
                object.insert("name".into(), span.name().into());
                let extensions = span.extensions();
                if let Some(formatted) = extensions.get::<FormattedFields<N>>()
                    && let Ok(Value::Object(fields)) =
                        serde_json::from_str::<Value>(formatted.fields.as_str())
                {
                    object.extend(fields);
                }
                spans.push(Value::Object(object));
            }
            line.insert("spans".into(), Value::Array(spans));
        }
        let text = serde_json::to_string(&line).map_err(|_| std::fmt::Error)?;
        writeln!(writer, "{text}")
    }
}
