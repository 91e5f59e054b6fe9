//! Where reports leave the agent: alert lines on stdout and the summary.
pub mod alert;
pub mod clock;
