//! Logging set up from `TOROID_DEBUG` and `TOROID_DEBUG_SUBSYS` (read here, as every variable
//! is read in `config`), unless the application installed its own `tracing` subscriber.

use std::sync::OnceLock;

/// Sets up logging from `TOROID_DEBUG` (`WARN` default, `INFO`, `TRACE`, ...) and
/// `TOROID_DEBUG_SUBSYS` (comma list of subsystems: `INIT,NET,COLL,ENV,TUNING,STORE`, `ALL`).
/// Does nothing when the application installed its own `tracing` subscriber first.
pub fn init_logging() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let level = std::env::var("TOROID_DEBUG").unwrap_or_default();
        let level = match level.trim().to_ascii_uppercase().as_str() {
            "" | "WARN" | "WARNING" => "warn",
            "VERSION" | "ERROR" => "error",
            "INFO" => "info",
            "DEBUG" => "debug",
            "TRACE" => "trace",
            "OFF" | "NONE" => "off",
            _ => "warn",
        };
        let subsys = std::env::var("TOROID_DEBUG_SUBSYS").unwrap_or_default();
        let mut directives = String::new();
        let subsys: Vec<String> =
            subsys.split(',').map(|s| s.trim().to_ascii_lowercase()).filter(|s| !s.is_empty()).collect();
        if subsys.is_empty() || subsys.iter().any(|s| s == "all") {
            directives.push_str(&format!("warn,toroid={level}"));
        } else {
            // Warnings of every subsystem always show; the level applies to the chosen ones.
            directives.push_str("warn");
            for s in &subsys {
                directives.push_str(&format!(",toroid::{s}={level}"));
            }
        }
        let filter = tracing_subscriber::EnvFilter::try_new(&directives)
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_target(true)
            .try_init();
    });
}
