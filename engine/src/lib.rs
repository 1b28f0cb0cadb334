//! Tidepool's local storage engine (placeholder; being built in issue 3).
