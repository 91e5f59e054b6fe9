//! The raw settings of `stallwatch run` as one source gives them: the
//! flags (with their `STALLWATCH_*` variables) or the config file, each
//! setting `None` where that source does not say; and how the flags go
//! over the file. [`super::resolve()`] makes them a [`super::RunConfig`].
use std::{net::SocketAddr, path::PathBuf, time::Duration};

use super::{
    RuleSetting,
    values::{parse_count, parse_duration, parse_pid},
};
use crate::{
    export::{alert::Format, metrics, otlp::Protocol},
    run::OnExit,
};

/// `stallwatch run`'s settings as one source gives them (the flags, or the
/// file); `None`: that source does not say. The flags are these fields.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct RunSettings {
    /// The process to watch (the prefill server); the agent ends when it
    /// exits. Without it, every process matching the selectors below is
    /// watched, including ones started later.
    #[arg(long, value_parser = parse_pid, env = "STALLWATCH_PID")]
    pub pid: Option<u32>,
    /// Select processes by executable: a basename, or a full path.
    #[arg(long, value_name = "NAME", env = "STALLWATCH_EXE")]
    pub exe: Option<String>,
    /// Select processes that have this library mapped (e.g. libnixl.so);
    /// checked again for a while after each exec, as it may be loaded late.
    #[arg(long, value_name = "NAME", env = "STALLWATCH_LIB")]
    pub lib: Option<String>,
    /// Select processes whose command line (arguments joined by spaces)
    /// matches this regular expression.
    #[arg(long, value_name = "REGEX", env = "STALLWATCH_CMDLINE")]
    pub cmdline: Option<String>,
    /// Select processes whose /proc/PID/cgroup contains this text (a
    /// container id, a pod UID).
    #[arg(long, value_name = "TEXT", env = "STALLWATCH_CGROUP")]
    pub cgroup: Option<String>,
    /// A built-in profile name (see `stallwatch profile list`) or the
    /// path of a profile TOML file, for the --pid or the selected
    /// processes. Without it, each process is watched with the profile of
    /// the first rule it matches: the config file's `[[rule]]` tables, then
    /// the built-in rules (SGLang on Mooncake and on NIXL, vLLM, NIXL).
    #[arg(long, env = "STALLWATCH_PROFILE")]
    pub profile: Option<String>,
    /// The config file's `[[rule]]` tables (no flag: a rule list is a file's).
    #[arg(skip)]
    pub rules: Vec<RuleSetting>,
    /// Whether the built-in rules follow the file's (`builtin_rules`; no
    /// flag) [default: true].
    #[arg(skip)]
    pub builtin_rules: Option<bool>,
    /// How long a request may stay silent before it is reported stalled
    /// [default: 60s].
    #[arg(long, value_parser = parse_duration, env = "STALLWATCH_TIMEOUT")]
    pub timeout: Option<Duration>,
    /// Resolution of the stall timer: a stall is reported within a tick of its timeout [default: 10ms].
    /// The agent wakes when one can be due, and reads the ring buffer at least every 100 ms.
    #[arg(long, value_parser = parse_duration, env = "STALLWATCH_TICK")]
    pub tick: Option<Duration>,
    /// Most requests tracked at once; beyond it the stalest is evicted
    /// (and reported) [default: 1000000].
    #[arg(long, env = "STALLWATCH_MAX_TRACKED", value_parser = parse_count)]
    pub max_tracked: Option<usize>,
    /// Alert line format on stdout [default: human].
    #[arg(long, value_enum, env = "STALLWATCH_OUTPUT")]
    pub output: Option<Format>,
    /// Export spans over OTLP to this collector (e.g.
    /// `http://127.0.0.1:4318`). Without it, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    /// or OTEL_EXPORTER_OTLP_ENDPOINT; none set: no export.
    #[arg(long, value_name = "URL", env = "STALLWATCH_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// OTLP transport (default: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL, else http).
    #[arg(long, value_enum, value_name = "PROTOCOL", env = "STALLWATCH_OTLP_PROTOCOL")]
    pub otlp_protocol: Option<Protocol>,
    /// Serve Prometheus metrics at /metrics on PORT (127.0.0.1), :PORT
    /// (every IPv4 interface, as in a pod) or ADDRESS:PORT (`[::]:PORT` for
    /// IPv6 too).
    #[arg(long, value_name = "[ADDRESS:]PORT", value_parser = metrics::parse_addr, env = "STALLWATCH_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Serve `stallwatch inflight` on this unix socket (its directory is
    /// created 0700, and refused if another user owns it, can write to it
    /// or a symlink leads to it; the socket is 0600) [default: /run/stallwatch/stallwatch.sock].
    #[arg(long, value_name = "PATH", env = "STALLWATCH_SOCKET")]
    pub socket: Option<PathBuf>,
    /// Pin the probes and the kernel's in-flight table here (on bpffs), so
    /// a restarted agent takes over every request in flight; one directory
    /// per agent, created 0700, refused as `--socket`'s is [default: /sys/fs/bpf/stallwatch].
    #[arg(long, value_name = "PATH", env = "STALLWATCH_BPF_DIR")]
    pub bpf_dir: Option<PathBuf>,
    /// Name each watched process's pod from the Kubernetes API: `off`;
    /// `in-cluster` (in a pod: the API server of KUBERNETES_SERVICE_HOST and
    /// _PORT, with the pod's service account); an https:// URL (with the
    /// service account too); or an http:// URL asked without a token
    /// (`kubectl proxy`, e.g. http://127.0.0.1:8001). Only this node's pods
    /// (K8S_NODE_NAME) are listed. Off, a process in a container still has
    /// its container id [default: off].
    #[arg(long, value_name = "off|in-cluster|URL", env = "STALLWATCH_KUBERNETES")]
    pub kubernetes: Option<String>,
    /// The service account's directory (its `token`, re-read before every
    /// pod list, and `ca.crt`), for an in-cluster or https:// --kubernetes
    /// [default: /var/run/secrets/kubernetes.io/serviceaccount].
    #[arg(long, value_name = "DIR", env = "STALLWATCH_KUBERNETES_SERVICE_ACCOUNT")]
    pub kubernetes_service_account: Option<PathBuf>,
    /// Pin nothing: the probes and the in-flight state end with this agent.
    #[arg(long, env = "STALLWATCH_EPHEMERAL")]
    pub ephemeral: bool,
    /// At SIGINT/SIGTERM, leave the probes attached and the state pinned
    /// for the next agent (keep), or detach everything [default: keep].
    #[arg(long, value_enum, value_name = "WHAT", env = "STALLWATCH_ON_EXIT")]
    pub on_exit: Option<OnExit>,
    /// Also read, and probe, watched processes' libraries on FUSE
    /// filesystems. Off, such a process is not watched (and said so): a
    /// FUSE server, which a tenant can run, could hold the agent's read or
    /// the kernel's uprobe attach forever, past every signal. Turn it on
    /// for a FUSE filesystem the node runs itself (a lazy-pulling image
    /// snapshotter).
    #[arg(long, env = "STALLWATCH_TRUST_FUSE")]
    pub trust_fuse: bool,
}

impl RunSettings {
    /// The ids (clap's, the field names) of the settings given here.
    pub(super) fn given(&self) -> Vec<&'static str> {
        [
            ("pid", self.pid.is_some()),
            ("exe", self.exe.is_some()),
            ("lib", self.lib.is_some()),
            ("cmdline", self.cmdline.is_some()),
            ("cgroup", self.cgroup.is_some()),
            ("profile", self.profile.is_some()),
            ("rules", !self.rules.is_empty() || self.builtin_rules.is_some()),
            ("timeout", self.timeout.is_some()),
            ("tick", self.tick.is_some()),
            ("max_tracked", self.max_tracked.is_some()),
            ("output", self.output.is_some()),
            ("otlp_endpoint", self.otlp_endpoint.is_some()),
            ("otlp_protocol", self.otlp_protocol.is_some()),
            ("metrics_addr", self.metrics_addr.is_some()),
            ("socket", self.socket.is_some()),
            ("bpf_dir", self.bpf_dir.is_some()),
            ("kubernetes", self.kubernetes.is_some()),
            ("kubernetes_service_account", self.kubernetes_service_account.is_some()),
            ("ephemeral", self.ephemeral),
            ("on_exit", self.on_exit.is_some()),
            ("trust_fuse", self.trust_fuse),
        ]
        .into_iter()
        .filter_map(|(id, given)| given.then_some(id))
        .collect()
    }

    pub(super) fn has_selector(&self) -> bool {
        self.exe.is_some() || self.lib.is_some() || self.cmdline.is_some() || self.cgroup.is_some()
    }

    fn names_target(&self) -> bool {
        self.pid.is_some() || self.has_selector()
    }

    /// These settings (the flags) over `file`'s: each one given here wins;
    /// a target given here (a pid or any selector) replaces the file's
    /// whole target, so `--pid` works with a DaemonSet's selecting config,
    /// and a profile given here replaces the file's rules.
    pub fn over(self, file: RunSettings) -> RunSettings {
        let (pid, exe, lib, cmdline, cgroup) = if self.names_target() {
            (self.pid, self.exe, self.lib, self.cmdline, self.cgroup)
        } else {
            (file.pid, file.exe, file.lib, file.cmdline, file.cgroup)
        };
        let rules = if self.profile.is_some() { Vec::new() } else { file.rules };
        RunSettings {
            pid,
            exe,
            lib,
            cmdline,
            cgroup,
            profile: self.profile.or(file.profile),
            rules,
            builtin_rules: file.builtin_rules,
            timeout: self.timeout.or(file.timeout),
            tick: self.tick.or(file.tick),
            max_tracked: self.max_tracked.or(file.max_tracked),
            output: self.output.or(file.output),
            otlp_endpoint: self.otlp_endpoint.or(file.otlp_endpoint),
            otlp_protocol: self.otlp_protocol.or(file.otlp_protocol),
            metrics_addr: self.metrics_addr.or(file.metrics_addr),
            kubernetes: self.kubernetes.or(file.kubernetes),
            kubernetes_service_account: self.kubernetes_service_account.or(file.kubernetes_service_account),
            socket: self.socket.or(file.socket),
            bpf_dir: self.bpf_dir.or(file.bpf_dir),
            ephemeral: self.ephemeral || file.ephemeral,
            on_exit: self.on_exit.or(file.on_exit),
            trust_fuse: self.trust_fuse || file.trust_fuse,
        }
    }
}
