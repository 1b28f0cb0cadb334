//! `--log-format json`: one JSON object per line, with the trace and span
//! ids of the innermost span around the line that belongs to a trace (a
//! line logged inside a request, or inside a span of a library or a debug
//! span within it, carries the request's trace; a line outside every trace
//! carries no ids).
//!
//! ```json
//! {"timestamp":"2026-11-27T07:00:00.000000Z","level":"DEBUG","target":"tidepool_node::server::blobs",
//!  "fields":{"message":"request answered","code":"OK","micros":812},
//!  "spans":[{"name":"request","node_id":1,"op":"put","shard_id":0,"term":3,"namespace":"default"}],
//!  "trace_id":"4bf92f3577b34da6a3ce929d0e0e4736","span_id":"00f067aa0ba902b7"}
//! ```

use opentelemetry::trace::TraceContextExt as _;
use serde_json::{Map, Value};
use tidepool_security::trace_context::{Untraced, hex};
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
        // The ids first: looking them up takes the span's extensions. The
        // innermost span that belongs to a trace: spans the OpenTelemetry
        // layer does not see (libraries', debug ones) have no context.
        // A span the sampling layer kept back (its trace not sampled)
        // carries its ids itself.
        let traced = if tidepool_security::trace_context::tracking() {
            let ids: Vec<(tracing::span::Id, Option<Untraced>)> = ctx
                .event_scope()
                .map(|scope| {
                    scope
                        .map(|span| (span.id(), span.extensions().get::<Untraced>().copied()))
                        .collect()
                })
                .unwrap_or_default();
            ids.iter().find_map(|(id, untraced)| match untraced {
                Some(untraced) => Some((hex(&untraced.trace_id), hex(&untraced.span_id))),
                None => trace_ids(id),
            })
        } else {
            None
        };
        if let Some((trace_id, span_id)) = traced {
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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::filter::filter_fn;
    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn parsed(lines: &Lines) -> Vec<Value> {
        let bytes = lines.0.lock().unwrap().clone();
        String::from_utf8(bytes)
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }

    /// A line logged inside a span OpenTelemetry does not see (a library's,
    /// or one kept out as the shard owner's is) that is itself inside a
    /// traced request carries the request's ids; a line outside every trace
    /// carries none; a line inside a request whose caller did not sample it
    /// carries the caller's trace id.
    #[test]
    fn lines_carry_the_ids_of_the_innermost_traced_span() {
        tidepool_security::trace_context::set_tracking(true);
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::registry()
            .with(
                tracing_subscriber::fmt::layer()
                    .event_format(JsonLines)
                    .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
                    .with_writer(move || writer.clone())
                    // Only this test's lines (others in the binary log too).
                    .with_filter(filter_fn(|m| m.target().starts_with(module_path!()))),
            )
            .with(
                crate::sampling::Sampling::new(
                    tracing_opentelemetry::layer().with_tracer(provider.tracer("test")),
                    crate::sampling::Rule::default(),
                )
                .with_filter(filter_fn(|m| !(m.is_span() && m.name() == "untraced"))),
            );
        // Global, as a process installs it: inside an event's dispatch a
        // scoped dispatcher is not found again (tracing-core guards against
        // re-entry), so the ids could not be looked up.
        tracing::subscriber::set_global_default(subscriber).unwrap();
        let request = tracing::info_span!("request", op = "get");
        let request_ids = request.id().and_then(|id| trace_ids(&id)).unwrap();
        request.in_scope(|| {
            tracing::info!("in the request");
            tracing::info_span!("untraced", library = true)
                .in_scope(|| tracing::info!("in a library span inside the request"));
        });
        let root = tracing::info_span!("untraced", scope = "owner");
        root.in_scope(|| tracing::info!("outside every trace"));
        let untraced_root = root.id().and_then(|id| trace_ids(&id));
        assert!(untraced_root.is_none());
        // A request whose caller did not sample its trace: kept from
        // OpenTelemetry, its lines carry the caller's trace id.
        let caller = tidepool_security::trace_context::from_traceparent(
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
        );
        let unsampled = tidepool_security::trace_context::continued(
            caller,
            || tracing::info_span!(parent: None, "request", op = "put"),
        );
        let kept_back = tidepool_security::trace_context::untraced(&unsampled).unwrap();
        unsampled.in_scope(|| tracing::info!("in an unsampled request"));
        let lines = parsed(&lines);
        assert_eq!(lines.len(), 4, "{lines:#?}");
        assert_eq!(lines[3]["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(lines[3]["span_id"], hex(&kept_back.span_id).as_str());
        assert_eq!(lines[3]["spans"][0]["op"], "put");
        for line in &lines[..2] {
            assert_eq!(line["trace_id"], request_ids.0.as_str(), "{line}");
            assert_eq!(line["span_id"], request_ids.1.as_str(), "{line}");
            assert_eq!(line["spans"][0]["name"], "request", "{line}");
            assert_eq!(line["spans"][0]["op"], "get", "{line}");
        }
        assert_eq!(lines[1]["spans"][1]["name"], "untraced");
        assert!(lines[2].get("trace_id").is_none(), "{}", lines[2]);
        assert!(lines[2].get("span_id").is_none(), "{}", lines[2]);
        assert_eq!(lines[2]["fields"]["message"], "outside every trace");
    }
}
