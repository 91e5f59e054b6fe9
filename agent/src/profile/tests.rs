//! Profile parsing and validation, on the built-ins and on hand-written TOML.
use std::path::PathBuf;

use stallwatch_common::{RetRule, base, cmp, slot_flags, stage};

use super::{load::parse_rule, *};
use crate::lifecycle::Stage;

#[test]
fn every_builtin_profile_parses() {
    for name in builtin_names() {
        let profile = Profile::load(name).unwrap_or_else(|err| panic!("{name}: {err:#}"));
        assert!(!profile.probes.is_empty(), "{name}");
    }
}

#[test]
fn the_nixl_profile_lowers_to_the_documented_slots() {
    let profile = Profile::load("nixl").unwrap();
    let create = &profile.probes[0];
    let cfg = create.slot_config();
    assert_eq!(cfg.flags & slot_flags::RETURN, slot_flags::RETURN);
    // The out-reference is r9: six arguments saved, handle read through it.
    assert_eq!(cfg.nargs, 6);
    assert_eq!((cfg.key.base, cfg.key.index, cfg.key.depth), (base::ARG, 5, 1));
    assert_eq!((cfg.ext.base, cfg.ext.depth, cfg.ext.offsets[0]), (base::KEY, 1, 144));
    assert_eq!((cfg.guard.base, cfg.guard.add), (base::KEY, 176));
    assert_eq!(
        cfg.flags & (slot_flags::HAS_EXT | slot_flags::HAS_GUARD | slot_flags::RET_I32),
        slot_flags::HAS_EXT | slot_flags::HAS_GUARD | slot_flags::RET_I32
    );
    // The post's return says done or failed when the post finished it;
    // the kernel picks the stage of the first rule that holds.
    let post = profile.probes.iter().find(|p| p.symbol.contains("postXferReq") && p.at == At::Return).unwrap();
    let rules = post.slot_config().rules;
    assert_eq!((rules[0].op, rules[0].value, rules[0].stage), (cmp::EQ, 0, stallwatch_common::stage::TRANSFER_DONE));
    assert_eq!((rules[1].op, rules[1].value, rules[1].stage), (cmp::LT, 0, stallwatch_common::stage::FAILED));
}

#[test]
fn the_sglang_profile_is_the_nixl_profile_with_its_posts_sent_and_its_release_probed_at_entry_and_return() {
    let nixl = Profile::load("nixl").unwrap();
    let sglang = Profile::load("sglang").unwrap();
    assert_eq!((sglang.name.as_str(), sglang.extends.as_deref()), ("sglang", Some("built-in profile `nixl`")));
    let of = |p: &Profile, name: &str| -> Vec<ProbeSpec> {
        p.probes.iter().filter(|p| p.symbol.contains(name)).cloned().collect()
    };
    let releases = |p: &Profile| of(p, "releaseXferReq");
    // Every other probe is nixl's own, from nixl's file.
    let others = |p: &Profile| -> Vec<ProbeSpec> {
        p.probes
            .iter()
            .filter(|p| !p.symbol.contains("releaseXferReq") && !p.symbol.contains("postXferReq"))
            .cloned()
            .collect()
    };
    assert_eq!(others(&sglang), others(&nixl));
    assert!(others(&sglang).iter().all(|p| &*p.origin == "built-in profile `nixl`"));
    // The posts are nixl's but sent (rooms follow them as they happen),
    // and done is complete: the post's return (done or failed) ends the
    // lifecycle, in the kernel too.
    let posts: Vec<ProbeSpec> = of(&nixl, "postXferReq")
        .into_iter()
        .map(|p| ProbeSpec { quiet: false, ends: p.at == At::Return, ..p })
        .collect();
    let without_place = |p: Vec<ProbeSpec>| -> Vec<ProbeSpec> {
        p.into_iter().map(|p| ProbeSpec { origin: "".into(), line: 0, ..p }).collect()
    };
    assert!(of(&nixl, "postXferReq").iter().all(|p| p.quiet), "nixl's posts are quiet");
    assert_eq!(without_place(of(&sglang, "postXferReq")), without_place(posts));
    assert_eq!((sglang.complete_at, nixl.complete_at), (CompleteAt::TransferDone, CompleteAt::Released));
    let ends = |p: &Profile| p.probes.iter().filter(|p| p.slot_config().flags & slot_flags::ENDS != 0).count();
    assert_eq!((ends(&sglang), ends(&nixl)), (1, 0));
    assert_eq!((sglang.activity.clone(), sglang.status.clone()), (nixl.activity.clone(), nixl.status.clone()));
    // The release: at its entry as nixl's, its status read there (a
    // failed transfer is `failed` however soon it is released); and at its
    // return, NIXL_SUCCESS the release done, anything else refused (the
    // handle lives on: posted again), for the rooms' leaks.
    let [entry, ret] = &releases(&sglang)[..] else { panic!("two release probes: {:?}", releases(&sglang)) };
    assert_eq!((entry.at, &*entry.origin, ret.at), (At::Entry, "built-in profile `sglang`", At::Return));
    assert_eq!(without_place(vec![entry.clone()]), without_place(releases(&nixl)));
    assert!(entry.entry_status.is_some(), "{entry:?}");
    let cfg = ret.slot_config();
    assert_eq!(
        cfg.flags & (slot_flags::RETURN | slot_flags::NEEDS_ARGS | slot_flags::RET_I32),
        slot_flags::RETURN | slot_flags::NEEDS_ARGS | slot_flags::RET_I32
    );
    assert_eq!((cfg.key.base, cfg.key.index, cfg.nargs), (base::ARG, 1, 2));
    assert_eq!(
        [0, 1].map(|n| (cfg.rules[n].op, cfg.rules[n].value, cfg.rules[n].stage)),
        [(cmp::EQ, 0, stallwatch_common::stage::RELEASED), (cmp::NE, 0, stallwatch_common::stage::TRANSFER_POSTED)]
    );
    assert_eq!(releases(&nixl)[0].at, At::Entry);
}

/// A directory of profile files for one test.
fn profile_dir(files: &[(&str, &str)]) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "stallwatch-profiles-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    dir
}

const ENTRY_F: &str = "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = { from = \"arg0\" }\n\n";
const RETURN_F: &str =
    "[[probe]]\nsymbol = \"f\"\nat = \"return\"\nkey = { from = \"arg0\" }\nevent = \"transfer_done\"\n\n";
const ENTRY_G: &str = "[[probe]]\nsymbol = \"g\"\nat = \"entry\"\nevent = \"released\"\nkey = { from = \"arg0\" }\n\n";
const ACTIVITY_P: &str = "[[activity]]\nsymbol = \"p\"\nkind = \"progress\"\n\n";

#[test]
fn a_profile_extending_another_replaces_the_functions_it_probes_and_adds_the_rest() {
    let base = format!(
        "name = \"base\"\n{ENTRY_F}{RETURN_F}{ENTRY_G}{ACTIVITY_P}[status]\nat = {{ from = \"key\", add = 8 }}\ntype = \"i32\"\nvalues = [{{ when = \"== 0\", event = \"transfer_done\" }}]\n"
    );
    let child = "extends = \"base.toml\"\nname = \"child\"\n\n[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"transfer_posted\"\nkey = { from = \"arg1\" }\n\n[[probe]]\nsymbol = \"h\"\nat = \"entry\"\nevent = \"aborted\"\nkey = { from = \"arg0\" }\n\n[[activity]]\nsymbol = \"p\"\nkind = \"post\"\n";
    let dir = profile_dir(&[("base.toml", &base), ("child.toml", child)]);
    let path = dir.join("child.toml");
    let profile = Profile::load(path.to_str().unwrap()).expect("child");
    let base_origin = dir.join("base.toml").display().to_string();
    assert_eq!((profile.name.as_str(), profile.extends.as_deref()), ("child", Some(base_origin.as_str())));
    // f's two probes gave way to the child's one; g stays, h is added.
    let probes: Vec<(&str, Stage, usize, bool)> = profile
        .probes
        .iter()
        .map(|p| {
            (
                p.symbol.as_str(),
                match p.action {
                    Action::Always(stage) => stage,
                    Action::OnReturn(_) => unreachable!(),
                },
                p.line,
                *p.origin == *base_origin,
            )
        })
        .collect();
    assert_eq!(
        probes,
        [("g", Stage::Released, 14, true), ("f", Stage::TransferPosted, 4, false), ("h", Stage::Aborted, 10, false)]
    );
    assert_eq!(profile.activity.iter().map(|a| (a.kind, a.line)).collect::<Vec<_>>(), [(ActivityKind::Post, 16)]);
    assert_eq!(profile.status.as_ref().map(|s| (&*s.origin, s.line)), Some((base_origin.as_str(), 24)));
    // A profile of nothing but `extends` is its base.
    let same = profile_dir(&[("base.toml", &base), ("same.toml", "extends = \"base.toml\"\n")]);
    let copy = Profile::load(same.join("same.toml").to_str().unwrap()).expect("same");
    assert_eq!(copy.probes.len(), 3);
    // Built-ins are found by name from any file.
    let on_nixl = profile_dir(&[("mine.toml", &format!("extends = \"nixl\"\n{ENTRY_F}"))]);
    let mine = Profile::load(on_nixl.join("mine.toml").to_str().unwrap()).expect("mine");
    assert_eq!(mine.probes.len(), Profile::load("nixl").unwrap().probes.len() + 1);
    for dir in [dir, same, on_nixl] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn complete_at_ends_lifecycles_at_transfer_done_per_probe_and_is_inherited() {
    let profile = |top: &str, body: &str| {
        format!(
            "{top}{ENTRY_F}[[probe]]\nsymbol = \"g\"\nat = \"return\"\nret = \"i32\"\nkey = {{ from = \"arg0\" }}\non_return = [\n{body}]\n"
        )
    };
    let done_or_failed =
        "  { when = \"== 0\", event = \"transfer_done\" },\n  { when = \"< 0\", event = \"failed\" },\n";
    let lazy = Profile::parse(&profile("complete_at = \"transfer_done\"\n", done_or_failed), "p.toml").expect("valid");
    let flags: Vec<bool> = lazy.probes.iter().map(|p| p.slot_config().flags & slot_flags::ENDS != 0).collect();
    assert_eq!((lazy.complete_at, flags), (CompleteAt::TransferDone, vec![false, true]));
    let eager = Profile::parse(&profile("complete_at = \"released\"\n", done_or_failed), "p.toml").expect("valid");
    assert!(eager.probes.iter().all(|p| p.slot_config().flags & slot_flags::ENDS == 0));
    assert_eq!(Profile::parse(&profile("", done_or_failed), "p.toml").unwrap().complete_at, CompleteAt::Released);
    // Rules that pick done and another live stage cannot end per probe.
    let mixed =
        "  { when = \"== 0\", event = \"transfer_done\" },\n  { when = \"== 1\", event = \"transfer_posted\" },\n";
    let err = error_of(&profile("complete_at = \"transfer_done\"\n", mixed));
    assert!(
        err.contains("line 8 ([[probe]] for `g`): its rules pick both transfer_done")
            && err.contains("split the rules"),
        "{err}"
    );
    Profile::parse(&profile("", mixed), "p.toml").expect("fine where done is not complete");
    let err = error_of(&profile("\ncomplete_at = \"done\"\n", done_or_failed));
    assert!(err.contains("p.toml, line 2: `complete_at = \"done\"`: expected \"released\""), "{err}");
    // Inherited, and overridden.
    let dir = profile_dir(&[
        ("lazy.toml", &profile("complete_at = \"transfer_done\"\n", done_or_failed)),
        ("child.toml", "extends = \"lazy.toml\"\n"),
        ("eager.toml", "extends = \"lazy.toml\"\ncomplete_at = \"released\"\n"),
    ]);
    let load = |name: &str| Profile::load(dir.join(name).to_str().unwrap()).unwrap();
    let (child, eager) = (load("child.toml"), load("eager.toml"));
    assert_eq!((child.complete_at, child.probes.iter().filter(|p| p.ends).count()), (CompleteAt::TransferDone, 1));
    assert_eq!((eager.complete_at, eager.probes.iter().filter(|p| p.ends).count()), (CompleteAt::Released, 0));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_extends_name_the_file_the_line_and_the_fix() {
    let dir = profile_dir(&[
        ("missing.toml", &format!("name = \"m\"\n\nextends = \"nowhere.toml\"\n{ENTRY_F}")),
        ("a.toml", &format!("extends = \"b.toml\"\n{ENTRY_F}")),
        ("b.toml", &format!("extends = \"a.toml\"\n{ENTRY_G}")),
        ("broken.toml", "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nkey = { from = \"arg0\" }\n"),
        ("on-broken.toml", &format!("extends = \"broken.toml\"\n{ENTRY_G}")),
        ("twice.toml", &format!("extends = \"nixl\"\n{ENTRY_F}{ENTRY_F}")),
    ]);
    let err = |name: &str| format!("{:#}", Profile::load(dir.join(name).to_str().unwrap()).unwrap_err());
    let missing = err("missing.toml");
    assert!(
        missing.contains("missing.toml, line 3 (`extends = \"nowhere.toml\"`)")
            && missing.contains("no built-in profile named `nowhere.toml`")
            && missing.contains("built-ins are demo, nixl"),
        "{missing}"
    );
    let looped = err("a.toml");
    assert!(
        looped.contains("extend one another (or take signals from one another) in a loop")
            && looped.contains("a.toml -> ")
            && looped.contains("b.toml -> "),
        "{looped}"
    );
    // An error in the base names the base's own line, under the line that extends it.
    let broken = err("on-broken.toml");
    assert!(
        broken.contains("on-broken.toml, line 1 (`extends = \"broken.toml\"`)")
            && broken.contains("broken.toml, line 1 ([[probe]] for `f`): no lifecycle event"),
        "{broken}"
    );
    // Probes of one file still may not both emit for one call.
    let twice = err("twice.toml");
    assert!(twice.contains("twice.toml, line 8 ([[probe]] for `f`): the [[probe]] on line 2"), "{twice}");
    let err = error_of("extends = 3\n");
    assert!(err.contains("extends"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_nixl_profile_reads_the_status_instead_of_probing_its_poll() {
    let profile = Profile::load("nixl").unwrap();
    assert!(profile.probes.iter().all(|p| !p.symbol.contains("getXferStatus")), "the hot poll is not probed");
    // No probe suppresses repeats: the polled function is not probed.
    assert!(profile.probes.iter().all(|p| !p.only_on_change));
    let status = profile.status.as_ref().expect("[status]");
    assert_eq!(
        (status.at.from, &status.at.deref[..], status.at.add, status.value),
        (From::Key, &[][..], 184, RetType::I32)
    );
    // NIXL's status codes, as 1.5.1 keeps them in the handle.
    for (value, stage) in [
        (1, Some(Stage::TransferPosted)),
        (0, Some(Stage::TransferDone)),
        (-1, Some(Stage::Enqueued)),
        (-10, Some(Stage::Failed)),
        (-3, Some(Stage::Failed)),
        (2, None),
    ] {
        assert_eq!(status.stage_of(value), stage, "status {value}");
    }
}

/// The release reads the handle's status at its entry: an error there
/// is the failure, anything else (or nothing readable) the release.
#[test]
fn the_nixl_release_reads_the_status_at_its_entry_and_an_error_is_failed() {
    let profile = Profile::load("nixl").unwrap();
    let release = profile.probes.iter().find(|p| p.symbol.contains("releaseXferReq")).unwrap();
    let cfg = release.slot_config();
    assert_eq!(
        cfg.flags & (slot_flags::ENTRY_VALUE | slot_flags::RET_I32 | slot_flags::RETURN),
        slot_flags::ENTRY_VALUE | slot_flags::RET_I32
    );
    assert_eq!(cfg.stage, stallwatch_common::stage::RELEASED);
    // One read: the i32 at handle + 184.
    assert_eq!((cfg.value.base, cfg.value.depth, cfg.value.offsets[0], cfg.value.add), (base::KEY, 1, 184, 0));
    assert_eq!(
        (cfg.rules[0].op, cfg.rules[0].value, cfg.rules[0].stage),
        (cmp::LT, -1, stallwatch_common::stage::FAILED)
    );
    assert_eq!(cfg.rules[1].op, cmp::NONE, "only the terminal rule");
    // No other nixl probe reads it.
    assert_eq!(profile.probes.iter().filter(|p| p.slot_config().flags & slot_flags::ENTRY_VALUE != 0).count(), 1);
    // Behind a pointer: the chain, then the value's own offset.
    let text = "[[probe]]\nsymbol = \"rel\"\nat = \"entry\"\nevent = \"released\"\nkey = { from = \"arg0\" }\nread_status = true\n\n\
                [status]\nat = { from = \"key\", deref = [8], add = 4 }\ntype = \"i64\"\nvalues = [\n  { when = \"== 1\", event = \"transfer_posted\" },\n  \
                { when = \"< 0\", event = \"failed\" },\n  { when = \"== 9\", event = \"aborted\" },\n]\n";
    let cfg = Profile::parse(text, "p.toml").unwrap().probes[0].slot_config();
    assert_eq!((cfg.value.depth, &cfg.value.offsets[..2], cfg.flags & slot_flags::RET_I32), (2, &[8, 4][..], 0));
    assert_eq!(
        (cfg.rules[0].stage, cfg.rules[1].stage),
        (stallwatch_common::stage::FAILED, stallwatch_common::stage::ABORTED)
    );
}

/// nixl names the build its offsets were checked against; a profile
/// extending it inherits that, or gives its own; without the offsets,
/// a probe on the library reads neither its external id nor its status.
#[test]
fn a_layout_names_the_builds_and_without_it_nothing_is_read_at_its_offsets() {
    let nixl = Profile::load("nixl").unwrap();
    let layout = nixl.layout.as_ref().expect("[layout]");
    assert_eq!(layout.object, "libnixl.so");
    assert!(layout.knows("C60AC851FDD67A4D9738B5B2F53BD4849505F241") && !layout.knows("00"));
    assert_eq!(Profile::load("sglang").unwrap().layout.as_ref(), Some(layout), "inherited");
    let off = nixl.without_offsets();
    assert!(off.probes.iter().all(|p| p.external_id.is_none() && p.entry_status.is_none()));
    assert!(off.probes.iter().all(|p| p.slot_config().flags & (slot_flags::HAS_EXT | slot_flags::ENTRY_VALUE) == 0));
    assert_eq!(off.probes.len(), nixl.probes.len(), "every lifecycle point stays");
    // sglang's dlist signal reads NIXL's own class: gone; the others stay.
    let sglang = Profile::load("sglang").unwrap();
    let names = |p: &Profile| p.signals.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
    assert!(names(&sglang).contains(&"nixl_dlist_remote_agent".to_owned()));
    let mut kept = names(&sglang);
    kept.retain(|name| name != "nixl_dlist_remote_agent");
    assert_eq!(names(&sglang.without_offsets()), kept);
    let text = |layout: &str| format!("extends = \"nixl\"\n[layout]\n{layout}");
    let own =
        Profile::parse(&text("object = \"libnixl.so\"\nbuild_ids = [\"AB01\"]\nchecked = \"x\"\n"), "p.toml").unwrap();
    assert_eq!(own.layout.expect("own").build_ids, ["ab01"]);
    let err = error_of(&text("object = \"libnixl.so\"\nbuild_ids = [\"xyz\"]\nchecked = \"x\"\n"));
    assert!(err.contains("([layout]): build id \"xyz\" is not hex bytes") && err.contains("readelf -n"), "{err}");
    let err = error_of(&text("object = \"libnixl.so\"\nbuild_ids = []\nchecked = \"x\"\n"));
    assert!(err.contains("`build_ids` is empty"), "{err}");
}

#[test]
fn read_status_the_kernel_cannot_follow_is_refused_with_the_fix() {
    let probe = |at: &str, extra: &str| {
        format!(
            "[[probe]]\nsymbol = \"rel\"\nat = \"{at}\"\n{extra}key = {{ from = \"arg0\" }}\nread_status = true\n\n"
        )
    };
    let status =
        |values: &str| format!("[status]\nat = {{ from = \"key\", add = 8 }}\ntype = \"i32\"\nvalues = [\n{values}]\n");
    let failed = "  { when = \"< 0\", event = \"failed\" },\n";
    let released = "event = \"released\"\n";
    let err = error_of(&probe("entry", released));
    assert!(err.contains("has none: add one"), "{err}");
    let err = error_of(&format!(
        "{}{}",
        probe("return", "on_return = [{ when = \"== 0\", event = \"released\" }]\n"),
        status(failed)
    ));
    assert!(err.contains("needs `at = \"entry\"`"), "{err}");
    let err = error_of(&format!(
        "{}{}",
        probe("entry", released),
        status("  { when = \"== 0\", event = \"transfer_done\" },\n")
    ));
    assert!(err.contains("has 0 rules for a terminal event"), "{err}");
    let overlap = "  { when = \"== -1\", event = \"enqueued\" },\n  { when = \"< 0\", event = \"failed\" },\n";
    let err = error_of(&format!("{}{}", probe("entry", released), status(overlap)));
    assert!(err.contains("takes values an earlier rule takes first"), "{err}");
    Profile::parse(&format!("{}{}", probe("entry", released), status(failed)), "p.toml").expect("valid");
}

#[test]
fn invalid_status_tables_name_their_line_and_the_fix() {
    let probe = "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"enqueued\"\nkey = { from = \"arg0\" }\n\n";
    let status = |at: &str, ty: &str, values: &str| {
        format!("{probe}[status]\nat = {at}\ntype = \"{ty}\"\nvalues = [\n{values}]\n")
    };
    let done = "  { when = \"== 0\", event = \"transfer_done\" },\n";
    Profile::parse(&status("{ from = \"key\", add = 184 }", "i32", done), "p.toml").expect("valid");
    Profile::parse(&status("{ from = \"key\", deref = [8], add = 4 }", "i64", done), "p.toml").expect("valid");
    let err = error_of(&status("{ from = \"arg1\", add = 184 }", "i32", done));
    assert!(err.contains("line 7 ([status]): `at.from = \"arg1\"`") && err.contains("from = \"key\""), "{err}");
    let err = error_of(&status("{ from = \"key\" }", "i32", done));
    assert!(err.contains("line 7 ([status])") && err.contains("the status field's offset"), "{err}");
    let err = error_of(&status("{ from = \"key\", add = 8 }", "u7", done));
    assert!(err.contains("u7"), "{err}");
    let err = error_of(&status("{ from = \"key\", add = 8 }", "i32", ""));
    assert!(err.contains("line 7 ([status]): `values` takes 1 to 16 rules, found 0"), "{err}");
    let err = error_of(&status(
        "{ from = \"key\", add = 8 }",
        "i32",
        "  { when = \"== 5000000000\", event = \"failed\" },\n",
    ));
    assert!(err.contains("line 7 ([status]): `when = \"== 5000000000\"` (line 11) never holds"), "{err}");
    let err = error_of(&status(
        "{ from = \"key\", add = 8 }",
        "i32",
        "  { when = \"< 0\", event = \"failed\" },\n  { when = \"== -1\", event = \"enqueued\" },\n",
    ));
    assert!(err.contains("`when = \"== -1\"` (line 12) never picks its event"), "{err}");
    let err = error_of(&status("{ from = \"key\", add = 8 }", "i32", "  { when = \"== 2\", event = \"released\" },\n"));
    assert!(err.contains("line 7 ([status]): `event = \"released\"`") && err.contains("no longer its own"), "{err}");
    let err = error_of(&status("{ from = \"key\", add = 8 }", "i32", "  { when = \"== 2\", event = \"finished\" },\n"));
    assert!(err.contains("unknown lifecycle event \"finished\""), "{err}");
    let err = error_of(&format!("{}colour = 1\n", status("{ from = \"key\", add = 8 }", "i32", done)));
    assert!(err.contains("colour"), "{err}");
}

#[test]
fn entry_probes_emit_every_hit_and_save_nothing() {
    let profile = Profile::parse(
        "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"released\"\nkey = { from = \"arg2\", deref = [8, 16], add = 4 }\n",
        "test",
    )
    .unwrap();
    let cfg = profile.probes[0].slot_config();
    assert_eq!(cfg.flags, slot_flags::CONFIGURED);
    assert_eq!(cfg.key.offsets[..2], [8, 16]);
    assert_eq!(cfg.key.add, 4);
    assert_eq!(cfg.stage, stallwatch_common::stage::RELEASED);
}

const ONE_PROBE: &str = "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"released\"\nkey = { from = \"arg0\" }\n";

#[test]
fn signals_lower_to_untracked_slots_reading_their_value_and_capture() {
    let text = format!(
        "{ONE_PROBE}\n[[signal]]\nname = \"frame\"\nobject = \"libzmq.so\"\nsymbol = \"zmq_msg_data\"\nat = \"return\"\n\
         value = {{ from = \"arg0\" }}\nbytes = {{ from = \"ret\" }}\n\n\
         [[signal]]\nname = \"peer\"\nsymbol = \"g\"\nat = \"entry\"\nvalue = {{ from = \"arg5\" }}\ntext = {{ from = \"arg3\", deref = [0] }}\n"
    );
    let profile = Profile::parse(&text, "test").unwrap();
    let [frame, peer] = profile.signals.as_slice() else { panic!("{:?}", profile.signals) };
    assert_eq!((frame.name.as_str(), frame.line, frame.object.as_deref()), ("frame", 7, Some("libzmq.so")));
    let cfg = frame.slot_config();
    assert_eq!(cfg.stage, stage::SIGNAL);
    let want = slot_flags::RETURN
        | slot_flags::NEEDS_ARGS
        | slot_flags::HAS_EXT
        | slot_flags::EXT_BYTES
        | slot_flags::CONFIGURED;
    assert_eq!((cfg.flags, cfg.nargs), (want, 1));
    assert_eq!((cfg.key.base, cfg.ext.base), (base::ARG, base::RET));
    let cfg = peer.slot_config();
    assert_eq!(cfg.flags, slot_flags::HAS_EXT | slot_flags::CONFIGURED);
    assert_eq!((cfg.key.index, cfg.ext.index, cfg.ext.depth), (5, 3, 1));
}

#[test]
fn invalid_signals_name_their_line_and_the_fix() {
    let signal = |body: &str| format!("{ONE_PROBE}[[signal]]\nname = \"s\"\nsymbol = \"g\"\n{body}");
    let err = error_of(&signal("at = \"entry\"\nvalue = { from = \"ret\" }\n"));
    assert!(err.contains("line 6 ([[signal]] `s`): `value.from = \"ret\"` needs `at = \"return\"`"), "{err}");
    let err = error_of(&signal(
        "at = \"return\"\nvalue = { from = \"ret\" }\ntext = { from = \"ret\" }\nbytes = { from = \"ret\" }\n",
    ));
    assert!(err.contains("either `text`") && err.contains("line 6"), "{err}");
    let err = error_of(&signal("at = \"entry\"\nret = \"i32\"\nvalue = { from = \"arg0\" }\n"));
    assert!(err.contains("`ret` describes a return value"), "{err}");
    let err = error_of(&signal("at = \"entry\"\n"));
    assert!(err.contains("value"), "{err}");
    let err = error_of(&format!(
        "{ONE_PROBE}[[signal]]\nname = \" \"\nsymbol = \"g\"\nat = \"entry\"\nvalue = {{ from = \"arg0\" }}\n"
    ));
    assert!(err.contains("`name` is empty"), "{err}");
    let twice = signal("at = \"entry\"\nvalue = { from = \"arg0\" }\n");
    let err = error_of(&format!("{twice}{}", twice.trim_start_matches(ONE_PROBE)));
    assert!(err.contains("line 11 ([[signal]] `s`): the [[signal]] on line 6 has the same name"), "{err}");
}

#[test]
fn a_msgpack_capture_needs_bytes_a_short_tag_and_a_reachable_element() {
    let signal = |extra: &str| {
        format!(
            "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"released\"\nkey = {{ from = \"arg0\" }}\n\
             [[signal]]\nname = \"room\"\nobject = \"libzmq.so\"\nsymbol = \"zmq_msg_data\"\nat = \"return\"\n\
             value = {{ from = \"arg0\" }}\n{extra}\n"
        )
    };
    let profile = Profile::parse(
        &signal("bytes = { from = \"ret\" }\nmsgpack = { element = 27, tag = \"TokenizedGenerateReqInput\" }"),
        "p.toml",
    )
    .expect("valid");
    let cfg = profile.signals[0].slot_config();
    assert_ne!(cfg.flags & slot_flags::EXT_MSGPACK, 0);
    assert_eq!((cfg.msgpack.element, cfg.msgpack.tag_len), (27, 25));
    assert_eq!(&cfg.msgpack.tag[..25], b"TokenizedGenerateReqInput");
    let error_of = |text: &str| Profile::parse(text, "p.toml").unwrap_err().to_string();
    let err = error_of(&signal("text = { from = \"ret\" }\nmsgpack = { element = 1 }"));
    assert!(err.contains("line 6 ([[signal]] `room`)") && err.contains("give `bytes` too"), "{err}");
    let err = error_of(&signal(&format!(
        "bytes = {{ from = \"ret\" }}\nmsgpack = {{ element = 1, tag = \"{}\" }}",
        "t".repeat(33)
    )));
    assert!(err.contains("`msgpack.tag` is 33 bytes; at most 32"), "{err}");
    let err = error_of(&signal("bytes = { from = \"ret\" }\nmsgpack = { element = 512 }"));
    assert!(err.contains("`msgpack.element = 512` is past what the kernel walks"), "{err}");
}

/// A signal's `when`, `extra` and `bytes_else` (what the `sglang`
/// profile's `zmq_recv` reads at `zmq_msg_close`) lower to the slot's
/// filter, entry value and capture choice.
#[test]
fn a_signal_filters_its_hits_reads_an_extra_value_and_picks_where_its_bytes_are() {
    let signal = |body: &str| {
        format!("{ONE_PROBE}[[signal]]\nname = \"frame\"\nobject = \"libzmq.so\"\nsymbol = \"zmq_msg_close\"\n{body}\n")
    };
    let text = signal(
        "at = \"entry\"\nwhen = { from = \"arg0\", deref = [0], is = \"!= 0\" }\n\
         value = { from = \"arg0\", deref = [40] }\nextra = { from = \"arg0\", deref = [8, 8] }\n\
         bytes = { from = \"arg0\", add = 8 }\n\
         bytes_else = { at = { from = \"arg0\", deref = [8, 0] }, unless_byte = { from = \"arg0\", add = 42 }, is = 101 }",
    );
    let profile = Profile::parse(&text, "p.toml").expect("valid");
    let cfg = profile.signals[0].slot_config();
    let want = slot_flags::FILTER
        | slot_flags::ENTRY_VALUE
        | slot_flags::EXT_SELECT
        | slot_flags::HAS_EXT
        | slot_flags::EXT_BYTES
        | slot_flags::CONFIGURED;
    assert_eq!(cfg.flags, want);
    assert_eq!((cfg.filter.base, cfg.filter.depth, cfg.filter.offsets[0]), (base::ARG, 1, 0));
    assert_eq!((cfg.filter_rule.op, cfg.filter_rule.value), (cmp::NE, 0));
    assert_eq!((cfg.key.depth, cfg.key.offsets[0]), (1, 40));
    assert_eq!((cfg.value.depth, cfg.value.offsets[..2].to_vec()), (2, vec![8, 8]));
    assert_eq!((cfg.ext.depth, cfg.ext.add), (0, 8));
    assert_eq!((cfg.ext_else.depth, cfg.ext_else.offsets[..2].to_vec()), (2, vec![8, 0]));
    assert_eq!((cfg.select.depth, cfg.select.add, cfg.select_byte), (0, 42, 101));
    assert_eq!(cfg.rules, [RetRule::default(); stallwatch_common::MAX_RET_RULES], "no rule: every hit is the signal");
    // The `extra` in `bytes_else`: read only where the bytes are at its `at`.
    let text = signal(
        "at = \"entry\"\nvalue = { from = \"arg0\", deref = [40] }\nbytes = { from = \"arg0\", add = 8 }\n\
         bytes_else = { at = { from = \"arg0\", deref = [8, 0] }, unless_byte = { from = \"arg0\", add = 42 }, is = 101, \
         extra = { from = \"arg0\", deref = [8, 8] } }",
    );
    let cfg = Profile::parse(&text, "p.toml").expect("valid").signals[0].slot_config();
    let flags = slot_flags::ENTRY_VALUE | slot_flags::VALUE_IF_ELSE | slot_flags::EXT_SELECT;
    assert_eq!(cfg.flags & flags, flags);
    assert_eq!(cfg.value.offsets[..2], [8, 8]);
    // At a return, the filter and the capture choice read saved arguments.
    let text = signal(
        "at = \"return\"\nwhen = { from = \"arg3\", is = \"> 0\" }\nvalue = { from = \"ret\" }\n\
         bytes = { from = \"ret\" }\n\
         bytes_else = { at = { from = \"ret\", deref = [0] }, unless_byte = { from = \"arg1\" }, is = 0 }",
    );
    let cfg = Profile::parse(&text, "p.toml").expect("valid").signals[0].slot_config();
    assert_eq!(cfg.nargs, 4);
    assert_ne!(cfg.flags & slot_flags::NEEDS_ARGS, 0);
}

#[test]
fn bad_filters_extras_and_byte_choices_name_their_line_and_the_fix() {
    let signal = |body: &str| format!("{ONE_PROBE}[[signal]]\nname = \"s\"\nsymbol = \"g\"\n{body}\n");
    let entry = |extra: &str| signal(&format!("at = \"entry\"\nvalue = {{ from = \"arg0\" }}\n{extra}"));
    let err = error_of(&entry("when = { from = \"arg0\", is = \"~ 1\" }"));
    assert!(err.contains("line 6 ([[signal]] `s`): `when.is`") && err.contains("expected a comparison"), "{err}");
    let err = error_of(&entry("when = { from = \"key\", deref = [0], is = \"!= 0\" }"));
    assert!(err.contains("`when.from = \"key\"`"), "{err}");
    let err = error_of(&entry("when = { from = \"arg0\", is = \"> 9223372036854775807\" }"));
    assert!(err.contains("never holds"), "{err}");
    let err = error_of(&entry("when = { from = \"arg0\" }"));
    assert!(err.contains("line 11") && err.contains("missing field `is`"), "{err}");
    let err = error_of(&signal("at = \"return\"\nvalue = { from = \"ret\" }\nextra = { from = \"arg0\" }"));
    assert!(err.contains("line 6") && err.contains("`extra` is a second value read at the entry"), "{err}");
    let choice = "bytes_else = { at = { from = \"arg0\", deref = [8, 0] }, unless_byte = { from = \"arg0\", add = 42 }, is = 101 }";
    let err = error_of(&entry(choice));
    assert!(err.contains("line 6") && err.contains("give `bytes` too"), "{err}");
    let err = error_of(&entry(&format!("text = {{ from = \"arg0\" }}\n{choice}")));
    assert!(err.contains("give `bytes` too"), "{err}");
    let err = error_of(&entry(&format!(
        "bytes = {{ from = \"arg0\", add = 8 }}\nextra = {{ from = \"arg1\" }}\n{}",
        choice.replace("is = 101", "is = 101, extra = { from = \"arg0\" }")
    )));
    assert!(err.contains("line 6") && err.contains("`extra` is given twice"), "{err}");
    let err = error_of(&entry(&format!(
        "bytes = {{ from = \"arg0\", add = 8 }}\n{}",
        choice.replace("is = 101", "is = 256")
    )));
    assert!(err.contains("`bytes_else.is = 256`") && err.contains("0 to 255"), "{err}");
    let err = error_of(&entry(&format!(
        "bytes = {{ from = \"arg0\", add = 8 }}\n{}",
        choice.replace("unless_byte = { from = \"arg0\", add = 42 }", "unless_byte = { from = \"ret\" }")
    )));
    assert!(err.contains("`bytes_else.unless_byte.from = \"ret\"` needs `at = \"return\"`"), "{err}");
}

#[test]
fn a_strings_capture_walks_a_bounded_list_or_one_string_and_bad_ones_name_their_line() {
    let signal = |extra: &str| {
        format!(
            "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"released\"\nkey = {{ from = \"arg0\" }}\n\
             [[signal]]\nname = \"notifs\"\nsymbol = \"getNotifs\"\nat = \"return\"\n\
             value = {{ from = \"arg1\" }}\n{extra}\n"
        )
    };
    let map = "first = 16, next = 0, begin = 40, end = 48, stride = 32";
    let profile = Profile::parse(
        &signal(&format!("strings = {{ from = \"arg1\", {map}, nodes = 8, items = 16, bytes = 512 }}")),
        "p.toml",
    )
    .expect("valid");
    let spec = &profile.signals[0];
    let cfg = spec.slot_config();
    assert_ne!(cfg.flags & slot_flags::EXT_STRINGS, 0);
    assert_ne!(cfg.flags & slot_flags::NEEDS_ARGS, 0, "the map's address is saved at the entry");
    assert_eq!(cfg.nargs, 2);
    let w = cfg.strings;
    assert_eq!((w.first, w.next, w.begin, w.end, w.stride, w.length), (16, 0, 40, 48, 32, 8));
    assert_eq!((w.nodes, w.items, w.chunks, w.list), (8, 16, 9, 1));
    assert_eq!(spec.strings.as_ref().map(|s| s.records()), Some(8 * 16 * 9));
    let one = Profile::parse(&signal("strings = { from = \"arg2\", bytes = 100 }"), "p.toml").expect("one string");
    let w = one.signals[0].slot_config().strings;
    assert_eq!((w.list, w.nodes, w.items, w.chunks, w.length), (0, 1, 1, 2, 8));
    let err = error_of(&signal("strings = { from = \"arg1\", first = 16, bytes = 64 }"));
    assert!(err.contains("line 6 ([[signal]] `notifs`)") && err.contains("all of `first`, `next`"), "{err}");
    let err = error_of(&signal(&format!("strings = {{ from = \"arg1\", {map}, bytes = 64 }}")));
    assert!(err.contains("needs `nodes` and `items`"), "{err}");
    let err =
        error_of(&signal(&format!("strings = {{ from = \"arg1\", {map}, nodes = 64, items = 64, bytes = 512 }}")));
    assert!(err.contains("past the kernel's bound of 4096: lower `nodes`, `items` or `bytes`"), "{err}");
    let err = error_of(&signal("strings = { from = \"arg1\", bytes = 0 }"));
    assert!(err.contains("`strings.bytes = 0`"), "{err}");
    let err = error_of(&signal("strings = { from = \"arg1\", nodes = 2, bytes = 10 }"));
    assert!(err.contains("give `first` .. `stride` too"), "{err}");
    let err = error_of(&signal(&format!(
        "strings = {{ from = \"arg1\", {map}, stride = 0, nodes = 1, items = 1, bytes = 1 }}"
    )));
    assert!(err.contains("duplicate key") || err.contains("stride"), "{err}");
    let err = error_of(&signal("text = { from = \"arg1\" }\nstrings = { from = \"arg1\", bytes = 8 }"));
    assert!(err.contains("`strings` is a signal's capture of its own"), "{err}");
}

#[test]
fn the_vllm_profile_is_the_nixl_profile_with_vllms_notifications_read() {
    let vllm = Profile::load("vllm").expect("the vllm profile");
    let names: Vec<&str> = vllm.signals.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["vllm_read", "vllm_notif_sent", "vllm_notifs", "vllm_outputs"]);
    let nixl = Profile::load("nixl").expect("nixl");
    assert_eq!(vllm.probes.len(), nixl.probes.len(), "every probe the nixl profile's");
    assert!(vllm.signals[1].strings.as_ref().is_some_and(|s| s.list.is_none() && !s.raw));
    assert!(vllm.signals[2].strings.as_ref().is_some_and(|s| s.list.is_some() && s.turns() <= 4096));
    // The engine's outputs: raw bytes, only of a frame that starts as an
    // EngineCoreOutputs does (a fixarray, then a positive fixint).
    let outputs = vllm.signals[3].slot_config();
    assert!(vllm.signals[3].strings.as_ref().is_some_and(|s| s.raw && s.bytes == 16128 && s.chunks() == 256));
    assert!(vllm.signals[3].optional && !vllm.signals[2].optional, "only libzmq's may be missing");
    assert_eq!(outputs.strings.raw, 1);
    assert_eq!((outputs.filter_mask, outputs.filter_rule.op, outputs.filter_rule.value), (0x80f0, cmp::EQ, 0x90));
    let passes = |first: &[u8]| {
        let mut word = [0u8; 8];
        word[..first.len()].copy_from_slice(first);
        outputs.filter_rule.holds((u64::from_le_bytes(word) & outputs.filter_mask) as i64)
    };
    assert!(passes(&[0x95, 0x00, 0x91]) && passes(&[0x9a, 0x03]));
    assert!(!passes(&[0x95, 0xa5]) && !passes(&[0x95, 0xd9]) && !passes(&[0xdc, 0x00]) && !passes(&[0x82, 0x00]));
}

#[test]
fn a_filters_mask_keeps_the_bits_it_compares() {
    let with = |when: &str| {
        format!(
            "{ONE_PROBE}[[signal]]\nname = \"s\"\nsymbol = \"g\"\nat = \"entry\"\nvalue = {{ from = \"arg0\" }}\nwhen = {when}\n"
        )
    };
    let profile =
        Profile::parse(&with("{ from = \"arg0\", deref = [0], mask = 255, is = \"== 7\" }"), "p.toml").expect("valid");
    assert_eq!(profile.signals[0].slot_config().filter_mask, 255);
    let err = error_of(&with("{ from = \"arg0\", mask = 0, is = \"== 7\" }"));
    assert!(err.contains("`when.mask = 0` keeps no bit"), "{err}");
    let err = error_of(&with("{ from = \"arg0\", mask = 15, is = \"== 16\" }"));
    assert!(err.contains("never holds for a value masked with 0xf"), "{err}");
}

#[test]
fn rules_parse_and_bad_ones_say_why() {
    assert_eq!(parse_rule(">= -3").unwrap(), RetRule { op: cmp::GE, stage: 0, _pad: [0; 6], value: -3 });
    assert_eq!(parse_rule("!=1").unwrap().op, cmp::NE);
    assert!(parse_rule("~ 1").unwrap_err().to_string().contains("expected a comparison"));
    assert!(parse_rule("== x").unwrap_err().to_string().contains("not an integer"));
}

fn error_of(text: &str) -> String {
    format!("{:#}", Profile::parse(text, "p.toml").unwrap_err())
}

#[test]
fn invalid_probes_name_the_line_and_the_fix() {
    let err = error_of("[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nkey = { from = \"ret\" }\nevent = \"enqueued\"\n");
    assert!(err.contains("line 1") && err.contains("needs `at = \"return\"`"), "{err}");
    let err = error_of(
        "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nkey = { from = \"arg0\" }\non_return = [{ when = \"== 0\", event = \"released\" }]\n",
    );
    assert!(err.contains("`on_return` needs `at = \"return\"`"), "{err}");
    let err =
        error_of("[[probe]]\nsymbol = \"f\"\nat = \"return\"\nkey = { from = \"arg10\" }\nevent = \"released\"\n");
    assert!(err.contains("expected \"arg0\" .. \"arg9\""), "{err}");
    let err = error_of(
        "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nkey = { from = \"arg0\", deref = [1, 2, 3, 4, 5] }\nevent = \"released\"\n",
    );
    assert!(err.contains("at most 4"), "{err}");
    let err = error_of("[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nkey = { from = \"arg0\" }\n");
    assert!(err.contains("no lifecycle event"), "{err}");
    let err = error_of("name = \"x\"\n");
    assert!(err.contains("no [[probe]] tables"), "{err}");
    let err = error_of(
        "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nkey = { from = \"arg0\" }\nevent = \"released\"\ncolour = 1\n",
    );
    assert!(err.contains("colour"), "{err}");
}

#[test]
fn rules_that_can_never_pick_their_event_are_refused_with_their_line() {
    let probe = |ret: &str, rules: &str| {
        format!(
            "[[probe]]\nsymbol = \"f\"\nat = \"return\"\nret = \"{ret}\"\nkey = {{ from = \"arg0\" }}\non_return = [\n{rules}]\n"
        )
    };
    let err = error_of(&probe("i32", "  { when = \"== 99999999999999\", event = \"transfer_done\" },\n"));
    assert!(
        err.contains("line 1 ([[probe]] for `f`)")
            && err.contains("`when = \"== 99999999999999\"` (line 7) never holds"),
        "{err}"
    );
    assert!(err.contains("between -2147483648 and 2147483647"), "{err}");
    // The same value is a fine 64-bit return.
    Profile::parse(&probe("i64", "  { when = \"== 99999999999999\", event = \"transfer_done\" },\n"), "p.toml")
        .expect("valid");
    let err = error_of(&probe(
        "i32",
        "  { when = \"< 0\", event = \"failed\" },\n  { when = \"== -3\", event = \"aborted\" },\n",
    ));
    assert!(err.contains("`when = \"== -3\"` (line 8) never picks its event"), "{err}");
    let err = error_of(&probe(
        "i64",
        "  { when = \"!= 7\", event = \"failed\" },\n  { when = \"== 3\", event = \"transfer_done\" },\n",
    ));
    assert!(err.contains("`when = \"== 3\"` (line 8) never picks its event"), "{err}");
    Profile::parse(
        &probe("i32", "  { when = \"== 0\", event = \"transfer_done\" },\n  { when = \"< 0\", event = \"failed\" },\n"),
        "p.toml",
    )
    .expect("valid");
}

#[test]
fn two_probes_emitting_for_one_call_are_refused_naming_both_lines() {
    let entry = |symbol: &str, event: &str, key: &str| {
        format!(
            "[[probe]]\nsymbol = \"{symbol}\"\nat = \"entry\"\nevent = \"{event}\"\nkey = {{ from = \"{key}\" }}\n\n"
        )
    };
    let err =
        error_of(&(entry("f", "enqueued", "arg0") + &entry("g", "released", "arg0") + &entry("f", "released", "arg0")));
    assert!(
        err.contains("line 13 ([[probe]] for `f`): the [[probe]] on line 1 probes the same function's entry"),
        "{err}"
    );
    // Another key, or another end of the function, is another lifecycle point.
    Profile::parse(&(entry("f", "enqueued", "arg0") + &entry("f", "released", "arg1")), "p.toml").expect("valid");
    let ret = |rules: &str, ret: &str| {
        format!(
            "[[probe]]\nsymbol = \"f\"\nat = \"return\"\nret = \"{ret}\"\nkey = {{ from = \"arg0\" }}\non_return = [{rules}]\n\n"
        )
    };
    let split = ret("{ when = \"== 0\", event = \"transfer_done\" }, { when = \"== 1\", event = \"aborted\" }", "i32")
        + &ret("{ when = \"< 0\", event = \"failed\" }", "i32");
    Profile::parse(&(entry("f", "enqueued", "arg0") + &split), "p.toml").expect("rules split over two probes");
    let overlap = ret("{ when = \"<= 0\", event = \"transfer_done\" }", "i32")
        + &ret("{ when = \"< 0\", event = \"failed\" }", "i32");
    assert!(error_of(&overlap).contains("both would emit for one call"));
    let types = ret("{ when = \"== 0\", event = \"transfer_done\" }", "i32")
        + &ret("{ when = \"< 0\", event = \"failed\" }", "i64");
    assert!(error_of(&types).contains("one function returns one type"), "{}", error_of(&types));
    let activity =
        "[[activity]]\nsymbol = \"p\"\nkind = \"progress\"\n\n[[activity]]\nsymbol = \"p\"\nkind = \"post\"\n";
    let err = error_of(&(entry("f", "enqueued", "arg0") + activity));
    assert!(
        err.contains("line 11 ([[activity]] for `p`): the [[activity]] on line 7 counts the same function"),
        "{err}"
    );
}

#[test]
fn an_external_id_at_the_key_itself_is_refused() {
    let with_ext = |key: &str, ret: &str, ext: &str| {
        format!(
            "[[probe]]\nsymbol = \"f\"\nat = \"return\"\nret = \"{ret}\"\nkey = {key}\nevent = \"enqueued\"\nexternal_id = {ext}\n"
        )
    };
    let err = error_of(&with_ext("{ from = \"arg0\", deref = [0] }", "i64", "{ from = \"key\" }"));
    assert!(
        err.contains(
            "line 1 ([[probe]] for `f`): `external_id = { from = \"key\" }` would read at the address the key holds"
        ),
        "{err}"
    );
    let err = error_of(&with_ext("{ from = \"arg0\" }", "i64", "{ from = \"arg1\", guard = { from = \"key\" } }"));
    assert!(err.contains("`external_id.guard = { from = \"key\" }`"), "{err}");
    let err = error_of(&with_ext("{ from = \"ret\" }", "i32", "{ from = \"key\", deref = [8] }"));
    assert!(err.contains("the key is a 32-bit return value"), "{err}");
    // Through the key, as the nixl profile reads its notification message.
    Profile::parse(
        &with_ext(
            "{ from = \"arg0\", deref = [0] }",
            "i64",
            "{ from = \"key\", deref = [144], guard = { from = \"key\", add = 176 } }",
        ),
        "p.toml",
    )
    .expect("valid");
}

#[test]
fn return_probes_save_as_many_arguments_as_they_read() {
    let profile = Profile::parse(
        "[[probe]]\nsymbol = \"f\"\nat = \"return\"\nkey = { from = \"arg1\" }\nexternal_id = { from = \"arg3\" }\nevent = \"released\"\n\n[[probe]]\nsymbol = \"g\"\nat = \"return\"\nkey = { from = \"ret\" }\nevent = \"enqueued\"\n",
        "test",
    )
    .unwrap();
    let with_args = profile.probes[0].slot_config();
    assert_eq!((with_args.flags & slot_flags::NEEDS_ARGS, with_args.nargs), (slot_flags::NEEDS_ARGS, 4));
    let from_ret = profile.probes[1].slot_config();
    assert_eq!((from_ret.flags & slot_flags::NEEDS_ARGS, from_ret.nargs), (0, 0));
}

/// A `Status` returned through a hidden result pointer: the rules compare
/// the `u16` behind `rax`, the key is an argument saved at entry.
const BEHIND_RAX: &str = "[[probe]]\nobject = \"mooncake/engine.so\"\nsymbol = \"free\"\nat = \"return\"\n\
                          ret = { from = \"ret\", deref = [0], type = \"u16\" }\nkey = { from = \"arg2\" }\n\
                          on_return = [\n  { when = \"== 0\", event = \"released\" },\n  { when = \"== 4\", event = \"failed\" },\n]\n";

#[test]
fn a_return_value_behind_the_return_register_lowers_to_a_read_through_it() {
    let profile = Profile::parse(BEHIND_RAX, "p.toml").expect("valid");
    let probe = &profile.probes[0];
    assert_eq!((probe.ret, probe.object.as_deref()), (RetType::U16, Some("mooncake/engine.so")));
    assert_eq!(probe.ret_at, Some(Source { from: From::Ret, deref: vec![0], add: 0 }));
    let cfg = probe.slot_config();
    let want = slot_flags::RETURN | slot_flags::RET_DEREF | slot_flags::RET_U16 | slot_flags::NEEDS_ARGS;
    assert_eq!(cfg.flags & (want | slot_flags::RET_I32 | slot_flags::RET_U8), want);
    assert_eq!((cfg.value.base, cfg.value.depth, cfg.value.offsets[0]), (base::RET, 1, 0));
    assert_eq!((cfg.key.base, cfg.key.index, cfg.nargs), (base::ARG, 2, 3));
    assert_eq!((cfg.rules[1].op, cfg.rules[1].value, cfg.rules[1].stage), (cmp::EQ, 4, stage::FAILED));
    // A plain narrow type reads the register itself.
    let plain = BEHIND_RAX.replace("{ from = \"ret\", deref = [0], type = \"u16\" }", "\"u8\"");
    let cfg = Profile::parse(&plain, "p.toml").expect("valid").probes[0].slot_config();
    assert_eq!(cfg.flags & (slot_flags::RET_DEREF | slot_flags::RET_U8), slot_flags::RET_U8);
    // A signal may read its return so too, and carries the value read.
    let signal = format!(
        "{ONE_PROBE}[[signal]]\nname = \"s\"\nsymbol = \"g\"\nat = \"return\"\n\
         ret = {{ from = \"ret\", deref = [8, 0], add = 2, type = \"u8\" }}\nvalue = {{ from = \"arg1\" }}\n"
    );
    let cfg = Profile::parse(&signal, "p.toml").expect("valid").signals[0].slot_config();
    assert_eq!(cfg.flags & (slot_flags::RET_DEREF | slot_flags::RET_U8), slot_flags::RET_DEREF | slot_flags::RET_U8);
    assert_eq!((cfg.value.depth, &cfg.value.offsets[..2], cfg.value.add), (2, &[8, 0][..], 2));
}

#[test]
fn a_bad_return_behind_the_register_names_its_line_and_the_fix() {
    let with = |ret: &str| BEHIND_RAX.replace("{ from = \"ret\", deref = [0], type = \"u16\" }", ret);
    let err = error_of(&with("{ from = \"ret\", type = \"u16\" }"));
    assert!(err.contains("line 1 ([[probe]] for `free`)") && err.contains("write `ret = \"u16\"`"), "{err}");
    let err = error_of(&with("{ from = \"arg0\", deref = [0], type = \"u16\" }"));
    assert!(err.contains("`ret.from = \"arg0\"`") && err.contains("from = \"ret\""), "{err}");
    let err = error_of(&with("{ from = \"ret\", deref = [0], type = \"u12\" }"));
    assert!(err.contains("`ret.type = \"u12\"`: expected \"i64\""), "{err}");
    let err = error_of(&with("{ from = \"ret\", deref = [0] }"));
    assert!(err.contains("type") && err.contains("line 1"), "{err}");
    let err = error_of(&with("{ from = \"ret\", deref = [0, 0, 0, 0, 0], type = \"u8\" }"));
    assert!(err.contains("`ret.deref` has 5 steps"), "{err}");
    let err = error_of(&with("\"u32\""));
    assert!(err.contains("`ret = \"u32\"`: expected \"i64\" (the default), \"i32\", \"u16\" or \"u8\""), "{err}");
    let err = error_of(&with("7"));
    assert!(err.contains("`ret = 7`"), "{err}");
    // The key from the register beside it would read the value, not the register.
    let err = error_of(&BEHIND_RAX.replace("key = { from = \"arg2\" }", "key = { from = \"ret\" }"));
    assert!(err.contains("`key.from = \"ret\"` beside a `ret` read behind the return register"), "{err}");
    // A u16 is never 70000 nor negative: the rule's line says so.
    let err = error_of(&BEHIND_RAX.replace("== 4", "== 70000"));
    assert!(err.contains("(line 9) never holds: a \"u16\" value is between 0 and 65535"), "{err}");
    let err = error_of(&BEHIND_RAX.replace("== 4", "< 0"));
    assert!(err.contains("(line 9) never holds"), "{err}");
    // Entry probes have no return to read.
    let err = error_of(&with("{ from = \"ret\", deref = [0], type = \"u16\" }").replace("\"return\"", "\"entry\""));
    assert!(err.contains("`ret` describes a return value"), "{err}");
    // Two probes on one return read it alike.
    let twice = format!(
        "{BEHIND_RAX}{}",
        with("\"u16\"").replace("on_return = [\n  { when = \"== 0\", event = \"released\" },\n", "on_return = [\n")
    );
    let err = error_of(&twice);
    assert!(
        err.contains("the [[probe]] on line 1 reads the same function's return as u16 behind the return register"),
        "{err}"
    );
}

#[test]
fn byte_and_u16_statuses_are_read_zero_extended() {
    let probe = "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"transfer_posted\"\nkey = { from = \"arg0\" }\n\n";
    let status = format!(
        "{probe}[status]\nat = {{ from = \"key\", add = 57 }}\ntype = \"u8\"\nvalues = [\n  \
         {{ when = \"== 1\", event = \"transfer_done\" }},\n  {{ when = \"== 0\", event = \"transfer_posted\" }},\n]\n"
    );
    let profile = Profile::parse(&status, "p.toml").expect("valid");
    let table = profile.status.as_ref().unwrap();
    assert_eq!((table.value, table.at.add), (RetType::U8, 57));
    assert_eq!(table.stage_of(1), Some(Stage::TransferDone));
    let err = error_of(&status.replace("== 1", "== 256"));
    assert!(
        err.contains("([status]): `when = \"== 256\"` (line 11) never holds: a \"u8\" value is between 0 and 255"),
        "{err}"
    );
    // At a probe's entry the kernel cuts the value to its byte too.
    let released = "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"released\"\nkey = { from = \"arg0\" }\nread_status = true\n\n\
         [status]\nat = { from = \"key\", add = 57 }\ntype = \"u16\"\nvalues = [{ when = \"== 6\", event = \"failed\" }]\n";
    let cfg = Profile::parse(released, "p.toml").expect("valid").probes[0].slot_config();
    assert_eq!(
        cfg.flags & (slot_flags::ENTRY_VALUE | slot_flags::RET_U16),
        slot_flags::ENTRY_VALUE | slot_flags::RET_U16
    );
}

#[test]
fn objects_named_by_a_path_suffix_are_checked() {
    Profile::parse(BEHIND_RAX, "p.toml").expect("a package path");
    for bad in ["mooncake//engine.so", "mooncake/", "../engine.so", "./engine.so"] {
        let err = error_of(&BEHIND_RAX.replace("mooncake/engine.so", bad));
        assert!(
            err.contains("line 1 ([[probe]] for `free`)") && err.contains(&format!("`object = \"{bad}\"` has")),
            "{err}"
        );
    }
    let activity = format!("{ONE_PROBE}[[activity]]\nobject = \"a//b.so\"\nsymbol = \"g\"\nkind = \"post\"\n");
    assert!(error_of(&activity).contains("line 6 ([[activity]]): `object = \"a//b.so\"` has an empty path component"));
    let layout =
        format!("{ONE_PROBE}[layout]\nobject = \"mooncake/../engine.so\"\nbuild_ids = [\"ab\"]\nchecked = \"x\"\n");
    assert!(error_of(&layout).contains("([layout]): `object = \"mooncake/../engine.so\"` has a `..` component"));
}

#[test]
fn a_pickle_capture_needs_bytes_short_names_and_one_key_for_items() {
    let signal = |extra: &str| {
        format!(
            "[[probe]]\nsymbol = \"f\"\nat = \"entry\"\nevent = \"released\"\nkey = {{ from = \"arg0\" }}\n\
             [[signal]]\nname = \"room\"\nobject = \"libzmq.so\"\nsymbol = \"zmq_msg_data\"\nat = \"return\"\n\
             value = {{ from = \"arg0\" }}\n{extra}\n"
        )
    };
    let profile = Profile::parse(
        &signal(
            "bytes = { from = \"ret\" }\npickle = { tags = [\"TokenizedGenerateReqInput\", \"AbortReq\"], keys = [\"bootstrap_room\", \"rid\"] }",
        ),
        "p.toml",
    )
    .expect("valid");
    let cfg = profile.signals[0].slot_config();
    assert_ne!(cfg.flags & slot_flags::EXT_PICKLE, 0);
    assert_eq!((cfg.pickle.tag_lens, cfg.pickle.key_lens, cfg.pickle.items), ([25, 8], [14, 3], 0));
    assert_eq!(&cfg.pickle.tags[1][..8], b"AbortReq");
    assert_eq!(&cfg.pickle.keys[0][..14], b"bootstrap_room");
    let items = Profile::parse(
        &signal(
            "bytes = { from = \"ret\" }\npickle = { tags = [\"BatchTokenIDOutput\"], keys = [\"rids\"], items = true }",
        ),
        "p.toml",
    )
    .expect("valid");
    assert_eq!(items.signals[0].slot_config().pickle.items, 1);
    let error_of = |text: &str| format!("{:#}", Profile::parse(text, "p.toml").unwrap_err());
    let err = error_of(&signal("text = { from = \"ret\" }\npickle = { tags = [\"T\"], keys = [\"k\"] }"));
    assert!(err.contains("line 6 ([[signal]] `room`)") && err.contains("give `bytes` too"), "{err}");
    let err = error_of(&signal("bytes = { from = \"ret\" }\npickle = { tags = [], keys = [\"k\"] }"));
    assert!(err.contains("`pickle.tags` has 0 names; give 1 to 2"), "{err}");
    let err = error_of(&signal(&format!(
        "bytes = {{ from = \"ret\" }}\npickle = {{ tags = [\"T\"], keys = [\"{}\"] }}",
        "k".repeat(33)
    )));
    assert!(err.contains("`pickle.keys` has") && err.contains("33 bytes"), "{err}");
    let err =
        error_of(&signal("bytes = { from = \"ret\" }\npickle = { tags = [\"T\"], keys = [\"a\", \"b\", \"c\"] }"));
    assert!(err.contains("`pickle.keys` has 3 names"), "{err}");
    let err = error_of(&signal(
        "bytes = { from = \"ret\" }\npickle = { tags = [\"T\"], keys = [\"a\", \"b\"], items = true }",
    ));
    assert!(err.contains("`pickle.items = true`") && err.contains("give one key"), "{err}");
    let err = error_of(&signal(
        "bytes = { from = \"ret\" }\nmsgpack = { element = 1 }\npickle = { tags = [\"T\"], keys = [\"k\"] }",
    ));
    assert!(err.contains("either `msgpack` or `pickle`"), "{err}");
}

/// The `sglang-mooncake` profile's signals, as resolved: its own on the
/// engine and on ZMQ's frames, then the `sglang` profile's four scheduler
/// signals (msgpack and pickled) under the `mooncake_` prefix, each the
/// same as `sglang`'s in everything but its name and where it is written.
/// Pinned by name and attach point too, so a change to either profile
/// that changes what Mooncake's watch attaches shows here.
#[test]
fn the_sglang_mooncake_profile_reads_the_sglang_profiles_zmq_signals_under_its_prefix() {
    let mooncake = Profile::load("sglang-mooncake").unwrap();
    let sglang = Profile::load("sglang").unwrap();
    let attach = |s: &SignalSpec| (s.name.clone(), s.object.clone().unwrap_or_default(), s.symbol.clone(), s.at);
    let close = "zmq_msg_close";
    let send = "zmq_msg_send";
    let zmq = |name: &str, symbol: &str| (name.to_owned(), "libzmq.so".to_owned(), symbol.to_owned(), At::Entry);
    let engine =
        |name: &str, symbol: &str, at| (name.to_owned(), "mooncake/engine.so".to_owned(), symbol.to_owned(), at);
    assert_eq!(
        mooncake.signals.iter().map(attach).collect::<Vec<_>>(),
        [
            engine(
                "mooncake_submit",
                "_ZN8mooncake14TransferEngine14submitTransferEmRKSt6vectorINS_9Transport15TransferRequestESaIS3_EE",
                At::Entry
            ),
            engine(
                "mooncake_segment",
                "_ZN8mooncake18TransferEngineImpl11openSegmentERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
                At::Return
            ),
            zmq("mooncake_zmq_recv", close),
            zmq("mooncake_zmq_send", send),
            zmq("mooncake_sglang_request_room", close),
            zmq("mooncake_sglang_output_rids", send),
            zmq("mooncake_sglang_request_pickle", close),
            zmq("mooncake_sglang_output_pickle", send),
        ]
    );
    let unplaced = |s: &SignalSpec, name: String| SignalSpec { origin: "".into(), line: 0, name, ..s.clone() };
    let taken: Vec<SignalSpec> =
        ["sglang_request_room", "sglang_output_rids", "sglang_request_pickle", "sglang_output_pickle"]
            .into_iter()
            .map(|name| {
                let spec =
                    sglang.signals.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("sglang has {name}"));
                unplaced(spec, format!("mooncake_{name}"))
            })
            .collect();
    let theirs: Vec<SignalSpec> = mooncake.signals[4..].iter().map(|s| unplaced(s, s.name.clone())).collect();
    assert_eq!(theirs, taken);
    assert!(mooncake.signals[4..].iter().all(|s| &*s.origin == "built-in profile `sglang`"));
    // What the kernel is given for each is the same, too.
    let slots = |specs: &[SignalSpec]| specs.iter().map(|s| format!("{:?}", s.slot_config())).collect::<Vec<_>>();
    assert_eq!(slots(&mooncake.signals[4..]), slots(&taken));
}

/// A `[[signals_from]]` table naming profile `from`, taking `names` under
/// `prefix`.
fn signals_from(from: &str, names: &str, prefix: &str) -> String {
    format!("[[signals_from]]\nprofile = \"{from}\"\nnames = [{names}]\nprefix = \"{prefix}\"\n\n")
}

const SIGNAL_S: &str = "[[signal]]\nname = \"s\"\nobject = \"libzmq.so\"\nsymbol = \"zmq_msg_send\"\nat = \"entry\"\nvalue = { from = \"arg2\" }\n\n";

#[test]
fn signals_taken_from_another_profile_are_its_own_under_the_prefix_in_the_order_named() {
    let t = format!("name = \"t\"\n{ENTRY_G}{SIGNAL_S}{}", SIGNAL_S.replace("\"s\"", "\"u\""));
    let dir = profile_dir(&[
        ("t.toml", &t),
        // Taken from a profile that inherits them, too.
        ("on-t.toml", "extends = \"t.toml\"\n"),
        ("mine.toml", &format!("{ENTRY_F}{SIGNAL_S}{}", signals_from("on-t.toml", "\"u\", \"s\"", "t_"))),
    ]);
    let mine = Profile::load(dir.join("mine.toml").to_str().unwrap()).expect("mine");
    let t_origin = dir.join("t.toml").display().to_string();
    let signals: Vec<(&str, &str, usize)> =
        mine.signals.iter().map(|s| (s.name.as_str(), &*s.origin, s.line)).collect();
    let mine_origin = dir.join("mine.toml").display().to_string();
    assert_eq!(signals, [("s", mine_origin.as_str(), 7), ("t_u", &t_origin, 15), ("t_s", &t_origin, 8)]);
    assert_eq!(mine.probes.len(), 1, "only signals are taken");
    let t = Profile::load(dir.join("t.toml").to_str().unwrap()).unwrap();
    assert_eq!(SignalSpec { name: "s".into(), ..mine.signals[2].clone() }, t.signals[0]);
    // A built-in by name, without a prefix: a selection.
    let plain =
        profile_dir(&[("p.toml", &format!("{ENTRY_F}{}", signals_from("sglang", "\"sglang_output_rids\"", "")))]);
    let p = Profile::load(plain.join("p.toml").to_str().unwrap()).expect("p");
    assert_eq!(p.signals.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["sglang_output_rids"]);
    for dir in [dir, plain] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn bad_signals_from_name_the_line_and_the_fix() {
    let dir = profile_dir(&[
        ("t.toml", &format!("{ENTRY_G}{SIGNAL_S}")),
        ("unknown.toml", &format!("{ENTRY_F}\n{}", signals_from("t.toml", "\"s\",\n  \"v\"", "x_"))),
        ("twice.toml", &format!("{ENTRY_F}{}", signals_from("t.toml", "\"s\", \"s\"", "x_"))),
        ("none.toml", &format!("{ENTRY_F}{}", signals_from("t.toml", "", "x_"))),
        ("nowhere.toml", &format!("{ENTRY_F}{}", signals_from("gone.toml", "\"s\"", "x_"))),
        // Collisions: with a [[signal]] of its own, another table's, an inherited one.
        (
            "own.toml",
            &format!("{ENTRY_F}{}{}", SIGNAL_S.replace("\"s\"", "\"x_s\""), signals_from("t.toml", "\"s\"", "x_")),
        ),
        (
            "both.toml",
            &format!("{ENTRY_F}{}{}", signals_from("t.toml", "\"s\"", ""), signals_from("t.toml", "\"s\"", "")),
        ),
        ("inherits.toml", &format!("extends = \"t.toml\"\n{}", signals_from("t.toml", "\"s\"", ""))),
        // A loop, through a table or through `extends`.
        ("a.toml", &format!("{ENTRY_F}{}", signals_from("b.toml", "\"s\"", "a_"))),
        ("b.toml", &format!("extends = \"a.toml\"\n{SIGNAL_S}")),
        ("self.toml", &format!("{ENTRY_F}{SIGNAL_S}{}", signals_from("self.toml", "\"s\"", "x_"))),
        ("layout.toml", &format!("{ENTRY_F}{}", signals_from("sglang", "\"nixl_dlist_remote_agent\"", "x_"))),
    ]);
    let err = |name: &str| format!("{:#}", Profile::load(dir.join(name).to_str().unwrap()).unwrap_err());
    let unknown = err("unknown.toml");
    assert!(
        unknown.contains(
            "unknown.toml, line 11 ([[signals_from]] `t.toml`): `t.toml` has no signal named `v`; its signals are s"
        ),
        "{unknown}"
    );
    let twice = err("twice.toml");
    assert!(
        twice.contains("twice.toml, line 9 ([[signals_from]] `t.toml`): `names` has `s` twice: keep one"),
        "{twice}"
    );
    let none = err("none.toml");
    assert!(
        none.contains("none.toml, line 7 ([[signals_from]] `t.toml`): `names` is empty: list the signals"),
        "{none}"
    );
    let nowhere = err("nowhere.toml");
    assert!(
        nowhere.contains("nowhere.toml, line 7 ([[signals_from]] `gone.toml`)")
            && nowhere.contains("no built-in profile named `gone.toml`"),
        "{nowhere}"
    );
    let own = err("own.toml");
    assert!(
        own.contains(
            "own.toml, line 14 ([[signals_from]]): it takes a signal named `x_s`, the name of the [[signal]] on line 7"
        ) && own.contains("another `prefix`"),
        "{own}"
    );
    let both = err("both.toml");
    assert!(
        both.contains(
            "both.toml, line 12 ([[signals_from]]): it takes a signal named `s`, the name of the signal of profile"
        ),
        "{both}"
    );
    let inherits = err("inherits.toml");
    assert!(
        inherits.contains(
            "inherits.toml, line 2 ([[signals_from]]): it takes a signal named `s`, the name of the signal of profile"
        ),
        "{inherits}"
    );
    for looped in [err("a.toml"), err("self.toml")] {
        assert!(looped.contains("(or take signals from one another) in a loop"), "{looped}");
    }
    let layout = err("layout.toml");
    assert!(
        layout.contains(
            "layout.toml, line 9 ([[signals_from]] `sglang`): signal `nixl_dlist_remote_agent` reads the classes"
        ) && layout.contains("copy it into a [[signal]] here"),
        "{layout}"
    );
    let err = error_of("[[signals_from]]\nprofile = \"sglang\"\nnames = [\"sglang_output_rids\"]\nprfix = \"x_\"\n");
    assert!(err.contains("prfix"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// `n` entry probes on functions of their own, as a profile file has them.
fn probes(n: usize) -> String {
    (0..n)
        .map(|i| {
            format!(
                "[[probe]]\nsymbol = \"_ZN3xfr4post{i:06}EPKcm\"\nat = \"entry\"\nevent = \"enqueued\"\n\
                 key = {{ from = \"arg1\", deref = [16] }}\n\n"
            )
        })
        .collect()
}

#[test]
fn a_profile_with_more_probes_than_slots_is_refused_naming_both_counts() {
    use stallwatch_common::MAX_SLOTS;
    let slots = MAX_SLOTS as usize;
    // The largest profile the agent can attach, one slot a table: checked
    // in full.
    let activity = "[[activity]]\nsymbol = \"ucp_put_nbx\"\nkind = \"post\"\n\n";
    let signal = "[[signal]]\nname = \"s\"\nsymbol = \"g\"\nat = \"entry\"\nvalue = { from = \"arg0\" }\n\n";
    let fits = format!("{}{activity}{signal}", probes(slots - 2));
    let profile = Profile::parse(&fits, "fits.toml").expect("fits");
    assert_eq!(profile.slots_needed(), slots);
    assert_eq!(profile.probes.last().map(|probe| probe.line), Some(6 * (slots - 3) + 1), "lines still right");
    // One more table, of any kind, is one slot too many.
    let err = error_of(&format!("{}{activity}{signal}", probes(slots - 1)));
    assert!(
        err.contains(&format!(
            "it needs {} probe slots per process ({} [[probe]], 1 [[activity]] and 1 [[signal]]",
            slots + 1,
            slots - 1
        )) && err.contains(&format!("an agent has {slots} in all")),
        "{err}"
    );
    // What an extension adds to its base's counts too: 600 + 600 more.
    let own: String = probes(1200).split_inclusive("\n\n").skip(600).collect();
    let dir = profile_dir(&[("base.toml", &probes(600)), ("child.toml", &format!("extends = \"base.toml\"\n{own}"))]);
    let err = format!("{:#}", Profile::load(dir.join("child.toml").to_str().unwrap()).unwrap_err());
    assert!(err.contains("it needs 1200 probe slots per process (1200 [[probe]]"), "{err}");
    // A 4 MiB file of 36 162 probes (issue 41's) is refused for its count,
    // before any table is checked one by one (or against the others, which
    // took time quadratic in their number: 24 s of CPU).
    let big = probes(36_162);
    assert!(big.len() > 3 << 20, "{}", big.len());
    let err = error_of(&big);
    assert!(err.contains("it needs 36162 probe slots per process") && err.contains("has 1024 in all"), "{err}");
}

#[test]
fn process_tables_name_what_fires_where_and_an_extension_keeps_its_bases() {
    let text = format!(
        "{ENTRY_F}[[signal]]\nname = \"s\"\nsymbol = \"h\"\nat = \"entry\"\nvalue = {{ from = \"arg0\" }}\n\n\
         [[process]]\ntitle = '^X::Engine'\nis = \"the engine\"\nfires = [\"s\", \"transfers\"]\n\n\
         [[process]]\ntitle = 'serve'\nis = \"the server\"\n"
    );
    let profile = Profile::parse(&text, "p.toml").expect("valid");
    let engine = profile.role_of(&["X::Engine_DP0".to_owned()]).expect("the engine");
    assert_eq!(
        (engine.is.as_str(), engine.signals.as_slice(), engine.transfers, engine.line),
        ("the engine", &["s".to_owned()][..], true, 13)
    );
    assert_eq!(engine.firing(), "the transfers, s");
    let server = profile.role_of(&["python".to_owned(), "serve".to_owned()]).expect("the server");
    assert!(!server.fires() && server.firing() == "none of the profile's probes");
    assert!(profile.role_of(&["other".to_owned()]).is_none());
    let dir = profile_dir(&[("base.toml", &text), ("child.toml", "extends = \"base.toml\"\n")]);
    let child = Profile::load(dir.join("child.toml").to_str().expect("path")).expect("valid");
    let titles = |p: &Profile| p.processes.iter().map(|r| (r.title.as_str().to_owned(), r.line)).collect::<Vec<_>>();
    assert_eq!(titles(&child), titles(&profile));
    assert!(child.processes[0].origin.ends_with("base.toml"), "where an inherited table comes from");

    let err = error_of(&format!("{ENTRY_F}[[process]]\ntitle = '('\nis = \"x\"\n"));
    assert!(err.contains("line 7 ([[process]])") && err.contains("not a valid regular expression"), "{err}");
    let err = error_of(&format!("{ENTRY_F}[[process]]\ntitle = 'x'\nis = \"x\"\nfires = [\"nope\"]\n"));
    assert!(err.contains("`fires` names `nope`") && err.contains("use `transfers`"), "{err}");
    let err = error_of(&format!("{ENTRY_F}[[process]]\ntitle = 'x'\nis = \" \"\n"));
    assert!(err.contains("`is` is empty"), "{err}");
}

/// `peer = true` marks a signal whose text names the peer of the transfer
/// its thread creates next: the built-ins say which of theirs do, and a
/// `peer` signal without a `text` is refused with the fix.
#[test]
fn a_peer_signal_names_the_remote_agent_in_its_text() {
    let peers = |name: &str| -> Vec<String> {
        let profile = Profile::load(name).expect("built-in");
        profile.signals.iter().filter(|spec| spec.peer).map(|spec| spec.name.clone()).collect()
    };
    assert_eq!(peers("sglang"), ["nixl_remote_agent", "nixl_dlist_remote_agent"]);
    assert_eq!(peers("vllm"), ["vllm_read"]);
    let signal = |capture: &str| {
        format!(
            "{ONE_PROBE}[[signal]]\nname = \"remote\"\nobject = \"libnixl.so\"\nsymbol = \"f\"\nat = \"entry\"\n\
             value = {{ from = \"arg0\" }}\n{capture}peer = true\n"
        )
    };
    Profile::parse(&signal("text = { from = \"arg4\", deref = [0] }\n"), "p.toml").expect("a text names the peer");
    let err = format!("{:#}", Profile::parse(&signal(""), "p.toml").expect_err("no text"));
    assert!(err.contains("`peer = true`") && err.contains("give `text`"), "{err}");
}
