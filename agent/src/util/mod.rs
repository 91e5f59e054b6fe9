//! Small helpers any layer may use; none of them knows a request.
pub mod build_info;
pub mod clock;
pub mod connections;
pub mod files;
pub mod lineage;
pub mod text;
pub mod tls;
pub mod trusted_dir;
pub mod warned;
