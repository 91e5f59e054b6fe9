//! Which profile watches which process.
//!
//! One agent watches every serving process of its node, each with the
//! profile that fits it: an ordered list of rules, each a [`Selector`] and
//! a profile; a process is watched with the profile of the first rule it
//! matches. The built-in rules ([`BUILTIN`]) tell the built-in profiles'
//! processes apart by the library they map and their titles (the ones
//! their profile's `[[process]]` tables list: a whole server's, where the
//! transfers run and where they do not), most specific first, so the
//! shipped DaemonSet watches SGLang on NIXL and on Mooncake, vLLM and bare
//! NIXL with no per-framework set-up; a config file's rules come before
//! them (or replace them).
//!
//! A process a later rule matches too is said once, unless that rule's
//! profile is one the first rule's profile extends (an SGLang scheduler
//! maps NIXL: the `sglang` profile is the `nixl` one and more). A process
//! that maps a library a rule names but matches no rule is said once too:
//! it looks like a serving process nobody set a rule for.
use std::collections::HashSet;

use tracing::{info, warn};

use super::discovery::{Facts, Selector};
use crate::{export::workload::Directory, profile::Profile, util::text};

/// A profile's place in the run's list of profiles ([`Rules::new`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProfileId(pub usize);

/// The built-in rules: (profile, library), most specific first. A rule
/// of a profile with `[[process]]` tables also matches a process's title
/// (its command line) against theirs: the titles a framework gives the
/// processes of a server (`setproctitle`: SGLang's `sglang::scheduler`,
/// vLLM's `VLLM::EngineCore`), so every process of one of its servers
/// that maps the library is its, and only those.
pub const BUILTIN: [(&str, &str); 4] = [
    ("sglang-mooncake", "mooncake/engine.so"),
    ("sglang", "libnixl.so"),
    ("vllm", "libnixl.so"),
    ("nixl", "libnixl.so"),
];

/// One rule: the processes its selector matches are watched with its
/// profile.
#[derive(Debug, Clone)]
pub struct Rule {
    pub selector: Selector,
    pub profile: Profile,
    /// Where it was written, for logs and errors: `built-in rule 2`,
    /// `config file /etc/stallwatch/config.toml, line 12`, `--profile`.
    pub origin: String,
}

impl Rule {
    /// The built-in rules, with their profiles loaded.
    pub fn builtin() -> anyhow::Result<Vec<Rule>> {
        BUILTIN
            .iter()
            .enumerate()
            .map(|(n, (name, lib))| {
                let profile = Profile::load(name)?;
                let titles: Vec<String> = profile.processes.iter().map(|role| format!("(?:{})", role.title)).collect();
                let title = (!titles.is_empty()).then(|| titles.join("|"));
                Ok(Rule {
                    selector: Selector::new(None, Some((*lib).to_owned()), title.as_deref(), None)?,
                    profile,
                    origin: format!("built-in rule {}", n + 1),
                })
            })
            .collect()
    }
}

/// A rule as the list keeps it: its profile by id.
#[derive(Debug)]
struct Kept {
    selector: Selector,
    profile: ProfileId,
    origin: String,
}

/// The rules of a run, and the processes already said to match several or
/// none.
pub struct Rules {
    rules: Vec<Kept>,
    /// Of each profile: its name, its origin and the origin of the one it
    /// extends (whether one refines another).
    profiles: Vec<(String, String, Option<String>)>,
    said: HashSet<u32>,
    /// Where a container's image is looked up ([`Self::with_pods`]).
    pods: Option<Directory>,
}

/// Most pids remembered as said: a node that execs without end must not
/// grow the set without end (a pid said again after a clear is a line more).
const MAX_SAID: usize = 4096;

impl Rules {
    /// The rules, in order, and the profiles they name, each once (by
    /// name): a [`ProfileId`] is a place in that list.
    pub fn new(rules: Vec<Rule>) -> (Self, Vec<Profile>) {
        let mut profiles: Vec<Profile> = Vec::new();
        let mut kept = Vec::with_capacity(rules.len());
        for rule in rules {
            let id = match profiles.iter().position(|p| p.name == rule.profile.name) {
                Some(at) => at,
                None => {
                    profiles.push(rule.profile);
                    profiles.len() - 1
                }
            };
            kept.push(Kept { selector: rule.selector, profile: ProfileId(id), origin: rule.origin });
        }
        let known = profiles.iter().map(|p| (p.name.clone(), p.origin.clone(), p.extends.clone())).collect();
        (Self { rules: kept, profiles: known, said: HashSet::new(), pods: None }, profiles)
    }

    /// Rules that select by image look it up in `pods` (the node's pods,
    /// watched with `--kubernetes`); without them such a rule matches
    /// nothing, said once here.
    pub fn with_pods(mut self, pods: Directory) -> Self {
        if !pods.watches_pods() {
            for rule in self.rules.iter().filter(|rule| rule.selector.image.is_some()) {
                warn!(
                    rule = %self.describe(rule),
                    "a rule selects by container image but no pods are watched: it matches nothing (set \
                     --kubernetes, as the DaemonSet does)"
                );
            }
        }
        self.pods = Some(pods);
        self
    }

    /// Whether a rule selects by container image (the node's pods are then
    /// listed before the start-up scan: [`Directory::listed`]).
    pub fn selects_by_image(&self) -> bool {
        self.rules.iter().any(|rule| rule.selector.image.is_some())
    }

    /// The profile `pid` is watched with: its first rule's, if any. One a
    /// later rule matches too is said once ([`Rules`]).
    pub fn choose(&mut self, pid: u32) -> Option<ProfileId> {
        self.judge(pid, false)
    }

    /// [`Self::choose`], and said once if no rule matches it but it maps a
    /// library a rule names: at the start-up scan, and for a process that
    /// matched nothing within its patience after an exec.
    pub fn choose_or_say(&mut self, pid: u32) -> Option<ProfileId> {
        self.judge(pid, true)
    }

    fn judge(&mut self, pid: u32, say_unmatched: bool) -> Option<ProfileId> {
        let mut facts = Facts::of(pid, self.pods.as_ref());
        let matched: Vec<usize> =
            (0..self.rules.len()).filter(|&at| self.rules[at].selector.matches_facts(&mut facts)).collect();
        let Some((&first, later)) = matched.split_first() else {
            // The command line only for a line that may be said: most
            // processes a scan or a recheck meets are none of the rules'.
            let near = say_unmatched
                .then(|| self.rules.iter().find(|rule| rule.selector.maps_its_library(&mut facts)))
                .flatten()
                .map(|rule| (self.describe(rule), facts.cmdline().unwrap_or("?").to_owned()));
            if let Some((near, process)) = near.filter(|_| self.say(pid)) {
                info!(
                    pid,
                    process = %text::value(&process),
                    near = %near,
                    "a process maps a library a rule names but matches no rule: not watched (add a rule for it in \
                     the --config file if it serves requests)"
                );
            }
            return None;
        };
        let profile = self.rules[first].profile;
        let others: Vec<String> = later
            .iter()
            .map(|&at| &self.rules[at])
            .filter(|rule| !self.refines(profile, rule.profile))
            .map(|rule| self.describe(rule))
            .collect();
        let process = (!others.is_empty()).then(|| facts.cmdline().unwrap_or("?").to_owned());
        if let Some(process) = process.filter(|_| self.say(pid)) {
            warn!(
                pid,
                process = %text::value(&process),
                watched_by = %self.describe(&self.rules[first]),
                also_matched = %text::value(&others.join("; ")),
                "a process matches several rules: it is watched with the first one's profile; make the rules \
                 exclusive (a narrower lib, cmdline, cgroup or image) or order them as meant"
            );
        }
        Some(profile)
    }

    /// The name of profile `id`.
    fn name(&self, id: ProfileId) -> &str {
        &self.profiles[id.0].0
    }

    /// The rules, one a line's worth each: for the start-up log and
    /// `config check`.
    pub fn describe_all(&self) -> String {
        self.rules.iter().map(|rule| self.describe(rule)).collect::<Vec<_>>().join("; ")
    }

    fn describe(&self, rule: &Kept) -> String {
        let selector = match rule.selector.describe() {
            empty if empty.is_empty() => "any process".to_owned(),
            selector => selector,
        };
        format!("{}: {selector} -> {}", rule.origin, self.name(rule.profile))
    }

    /// Whether a process of profile `first` matching a rule of `other` too
    /// is as meant: the same profile, or one `first` extends.
    fn refines(&self, first: ProfileId, other: ProfileId) -> bool {
        let (_, _, extends) = &self.profiles[first.0];
        first == other || extends.as_deref() == Some(self.profiles[other.0].1.as_str())
    }

    /// Whether `pid` is yet to be said (and from now on is).
    fn say(&mut self, pid: u32) -> bool {
        if self.said.len() >= MAX_SAID {
            self.said.clear();
        }
        self.said.insert(pid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(profile: &str, lib: Option<&str>, cmdline: Option<&str>, origin: &str) -> Rule {
        Rule {
            selector: match (lib, cmdline) {
                (None, None) => Selector::any(),
                _ => Selector::new(None, lib.map(str::to_owned), cmdline, None).unwrap(),
            },
            profile: Profile::load(profile).unwrap(),
            origin: origin.to_owned(),
        }
    }

    fn me() -> u32 {
        std::process::id()
    }

    #[test]
    fn the_builtin_rules_load_and_name_every_serving_profile_once() {
        let (rules, profiles) = Rules::new(Rule::builtin().unwrap());
        let names: Vec<&str> = profiles.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["sglang-mooncake", "sglang", "vllm", "nixl"]);
        let described = rules.describe_all();
        assert!(described.contains("built-in rule 2: lib=libnixl.so cmdline=/(?:^sglang::scheduler)|"), "{described}");
        assert!(described.contains("built-in rule 4: lib=libnixl.so -> nixl"), "{described}");
        // The specific profiles extend the catch-all one: an SGLang
        // scheduler on NIXL matching both is as meant.
        assert!(rules.refines(ProfileId(1), ProfileId(3)));
        assert!(rules.refines(ProfileId(2), ProfileId(3)));
        assert!(!rules.refines(ProfileId(3), ProfileId(1)), "the catch-all refines nothing");
        assert!(!rules.refines(ProfileId(0), ProfileId(1)), "Mooncake's SGLang is not NIXL's");
    }

    #[test]
    fn the_first_matching_rule_wins_and_a_process_no_rule_matches_is_not_watched() {
        let (mut rules, profiles) = Rules::new(vec![
            rule("vllm", Some("libnixl.so"), None, "rule 1"),
            rule("demo", Some("libc.so"), Some("nothing-is-called-this"), "rule 2"),
            rule("nixl", Some("libc.so"), None, "rule 3"),
            rule("sglang", None, None, "rule 4"),
        ]);
        let chosen = rules.choose(me()).expect("rule 3 matches");
        assert_eq!(profiles[chosen.0].name, "nixl");
        assert_eq!(rules.name(chosen), "nixl");
        // Rule 4 matches too and refines nothing: said once.
        assert!(rules.said.contains(&std::process::id()));
        let (mut none, _) = Rules::new(vec![rule("vllm", Some("libnixl.so"), None, "rule 1")]);
        assert_eq!(none.choose(me()), None);
    }

    #[test]
    fn a_process_mapping_a_rules_library_but_matching_none_is_said_once() {
        let (mut rules, _) = Rules::new(vec![rule("nixl", Some("libc.so"), Some("nothing-is-called-this"), "r")]);
        assert_eq!(rules.choose(me()), None);
        assert!(rules.said.is_empty(), "said only when asked to");
        assert_eq!(rules.choose_or_say(me()), None);
        assert!(rules.said.contains(&std::process::id()), "maps libc.so, which the rule names");
        assert!(!rules.say(std::process::id()), "once");
        let (mut unrelated, _) = Rules::new(vec![rule("nixl", Some("libnixl.so"), None, "r")]);
        assert_eq!(unrelated.choose_or_say(me()), None);
        assert!(unrelated.said.is_empty(), "a process mapping no rule's library is none of the agent's business");
    }

    #[test]
    fn two_rules_of_one_profile_share_it() {
        let (rules, profiles) =
            Rules::new(vec![rule("nixl", Some("libnixl.so"), None, "a"), rule("nixl", None, Some("x"), "b")]);
        assert_eq!(profiles.len(), 1);
        assert!(rules.describe_all().contains("a: lib=libnixl.so -> nixl; b: cmdline=/x/ -> nixl"));
    }
}
