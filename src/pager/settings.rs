//! The pager's settings as one table. [`settings!`] makes [`PagerConfig`] (its fields, their
//! defaults and docs) and [`SETTINGS`], through which every binding names, reads, sets,
//! prints and documents them: Python's `configure(**settings)` and `Config`, C's
//! `gpu_pager_configure_text`, the settings' `Display`. A new setting is one line of the
//! table (and its tests).

use std::fmt;

use super::config::Tuning;
use crate::names::{parse_bytes, parse_switch};
use crate::pump::CopyRoute;
use crate::{Error, Result};

/// How a setting's values are spelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettingKind {
    /// A byte count: a number, or with a `K`, `M`, `G` or `T` suffix (powers of 1024), or
    /// `max` (the largest).
    Bytes,
    /// On or off: `true`/`false`, `1`/`0`, `yes`/`no`.
    Switch,
    /// A copy route's name: `engine`, `kernel` or `fastest`.
    Route,
}

impl SettingKind {
    /// The kind's name as the bindings' docs say it.
    pub fn name(self) -> &'static str {
        match self {
            SettingKind::Bytes => "bytes",
            SettingKind::Switch => "switch",
            SettingKind::Route => "route",
        }
    }
}

/// One setting's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettingValue {
    /// Of a [`SettingKind::Bytes`] setting.
    Bytes(usize),
    /// Of a [`SettingKind::Switch`] setting.
    Switch(bool),
    /// Of a [`SettingKind::Route`] setting.
    Route(CopyRoute),
}

impl SettingValue {
    /// The value's kind.
    pub fn kind(self) -> SettingKind {
        match self {
            SettingValue::Bytes(_) => SettingKind::Bytes,
            SettingValue::Switch(_) => SettingKind::Switch,
            SettingValue::Route(_) => SettingKind::Route,
        }
    }

    /// Reads `text` as a value of `kind` (as [`SettingKind`] spells them); the error says
    /// what was expected.
    pub fn parse(kind: SettingKind, text: &str) -> std::result::Result<SettingValue, String> {
        let t = text.trim();
        let bad = |what: &str| format!("{} is not {what}", quoted(t));
        match kind {
            SettingKind::Bytes => parse_bytes(t)
                .map(SettingValue::Bytes)
                .ok_or_else(|| bad("a byte count (e.g. 536870912, 512M, 4G or max)")),
            SettingKind::Switch => parse_switch(t)
                .map(SettingValue::Switch)
                .ok_or_else(|| bad("a switch (true or false)")),
            SettingKind::Route => {
                CopyRoute::from_name(t)
                    .map(SettingValue::Route)
                    .ok_or_else(|| {
                        let names: Vec<&str> = CopyRoute::ALL.iter().map(|r| r.name()).collect();
                        bad(&format!("a copy route ({})", names.join(", ")))
                    })
            }
        }
    }
}

/// As the bindings print it: a number, `true`/`false`, a route's name.
impl fmt::Display for SettingValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SettingValue::Bytes(n) => write!(f, "{n}"),
            SettingValue::Switch(b) => write!(f, "{b}"),
            SettingValue::Route(r) => f.write_str(r.name()),
        }
    }
}

/// The Rust types a setting can have.
pub trait SettingType: Copy {
    /// The kind of setting of this type.
    const KIND: SettingKind;
    /// `self` as a value.
    fn value(self) -> SettingValue;
    /// The value as this type, if it is of its kind.
    fn from_value(v: SettingValue) -> Option<Self>;
}

/// `SettingType` for `$ty`, the type of the `SettingKind::$kind` and `SettingValue::$kind`.
macro_rules! setting_type {
    ($($ty:ty => $kind:ident),+) => {$(
        impl SettingType for $ty {
            const KIND: SettingKind = SettingKind::$kind;
            fn value(self) -> SettingValue {
                SettingValue::$kind(self)
            }
            fn from_value(v: SettingValue) -> Option<Self> {
                match v {
                    SettingValue::$kind(x) => Some(x),
                    _ => None,
                }
            }
        }
    )+};
}

setting_type!(usize => Bytes, bool => Switch, CopyRoute => Route);

/// One row of [`SETTINGS`].
#[derive(Clone, Copy)]
pub struct Setting {
    /// The name every binding uses (the [`PagerConfig`] field's).
    pub name: &'static str,
    /// How its values are spelled.
    pub kind: SettingKind,
    doc: &'static str,
    get: fn(&PagerConfig) -> SettingValue,
    set: fn(&mut PagerConfig, SettingValue) -> bool,
}

impl fmt::Debug for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Setting")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl Setting {
    /// The setting named `name`, if any.
    pub fn named(name: &str) -> Option<&'static Setting> {
        SETTINGS.iter().find(|s| s.name == name)
    }

    /// The setting named `name`, or [`Error::InvalidArgument`] naming every setting.
    pub fn find(name: &str) -> Result<&'static Setting> {
        Self::named(name).ok_or_else(|| {
            let names = SETTINGS.iter().map(|s| s.name);
            let hint = crate::error::nearest_tag(name, names.clone())
                .map_or_else(String::new, |n| format!(" (did you mean {n}?)"));
            Error::InvalidArgument {
                tag: None,
                reason: format!(
                    "no setting is named {}{hint}; the settings: {}",
                    quoted(name),
                    names.collect::<Vec<_>>().join(", ")
                ),
            }
        })
    }

    /// Its default.
    pub fn default(&self) -> SettingValue {
        self.get(&PagerConfig::default())
    }

    /// Its docs, one paragraph in words every binding's user reads alike.
    pub fn doc(&self) -> String {
        self.doc
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Its value in `config`.
    pub fn get(&self, config: &PagerConfig) -> SettingValue {
        (self.get)(config)
    }

    /// Sets it in `config`; a value of another kind is [`Error::InvalidArgument`].
    pub fn set(&self, config: &mut PagerConfig, value: SettingValue) -> Result<()> {
        if (self.set)(config, value) {
            return Ok(());
        }
        Err(Error::InvalidArgument {
            tag: None,
            reason: format!(
                "setting {} takes a {} value, not a {} one",
                self.name,
                self.kind.name(),
                value.kind().name()
            ),
        })
    }

    /// Sets it in `config` from text ([`SettingValue::parse`]).
    pub fn set_text(&self, config: &mut PagerConfig, text: &str) -> Result<()> {
        let value = SettingValue::parse(self.kind, text).map_err(|e| Error::InvalidArgument {
            tag: None,
            reason: format!("setting {}: {e}", self.name),
        })?;
        self.set(config, value)
    }
}

/// The table: each setting's docs, name, type and default. Makes [`PagerConfig`] with a
/// hidden `tuning` field after the settings, its `Default`, and [`SETTINGS`].
macro_rules! settings {
    ($(#[doc = $sdoc:literal])* pub struct PagerConfig;
     $( $(#[doc = $doc:literal])+ $name:ident: $ty:ty = $default:expr; )+) => {
        $(#[doc = $sdoc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct PagerConfig {
            $( $(#[doc = $doc])+ pub $name: $ty, )+
            /// Knobs whose defaults are measured, moved only by tests and benchmarks.
            #[doc(hidden)]
            pub tuning: Tuning,
        }

        impl Default for PagerConfig {
            fn default() -> Self {
                PagerConfig { $( $name: $default, )+ tuning: Tuning::default() }
            }
        }

        /// Every setting of [`PagerConfig`], in the order of its fields.
        pub const SETTINGS: &[Setting] = &[ $(
            Setting {
                name: stringify!($name),
                kind: <$ty as SettingType>::KIND,
                doc: concat!($($doc, "\n"),+),
                get: |c| SettingType::value(c.$name),
                set: |c, v| match <$ty as SettingType>::from_value(v) {
                    Some(x) => {
                        c.$name = x;
                        true
                    }
                    None => false,
                },
            },
        )+ ];
    };
}

settings! {
    /// Pager settings: what a user of the pager chooses, one field per row of [`SETTINGS`].
    /// C sets them with `gpu_pager_configure` (or by name, `gpu_pager_configure_text`),
    /// Python with `gpu_pager.configure`.
    pub struct PagerConfig;

    /// Physical chunk size in bytes (default 512 MiB), rounded up to the device's
    /// granularity and to a power of two (0 is refused). Mapping costs per chunk; a region's
    /// last chunk wastes at most one chunk's rounding. A region's own chunk size overrides it.
    chunk_bytes: usize = super::DEFAULT_CHUNK_BYTES;
    /// A release copies only the parts of a preserve region that changed since its last
    /// backup or restore (default on).
    skip_unchanged: bool = true;
    /// After each restore, compare the device contents with the backup's hashes; a mismatch
    /// fails the resume as corrupted (default off: one hash pass per resume).
    verify_restore: bool = false;
    /// Who copies contents to the backup on release: `engine` (the default: it leaves the
    /// SMs to the application), `kernel` or `fastest`.
    save_route: CopyRoute = CopyRoute::Engine;
    /// Who restores contents on resume: `engine`, `kernel` or `fastest` (the default: right
    /// after a trainer's free the copy kernel can outrun the copy engine).
    restore_route: CopyRoute = CopyRoute::Fastest;
    /// Memory that comes back without its contents (a discard region, a tag dropped at its
    /// release) is filled with the poison pattern on resume, a NaN read as bf16, fp16 or
    /// fp32, so that reading it before writing it shows at once (default off; the
    /// environment variable `GPU_PAGER_POISON_DISCARDS=1` turns it on too).
    poison_discards: bool = false;
    /// A release that moved something logs one warning when this process holds more than
    /// this many bytes of device memory outside every region after it (the device's whole
    /// use outside the regions where NVML does not report this process); the audit shows
    /// all of it (default 4 GiB; the largest value: never).
    resident_warning_bytes: usize = super::RESIDENT_WARNING_BYTES;
    /// The most host memory that the backups in pinned or host memory, the KV caches' swap
    /// space and the file backups' staging buffers of every gpu-pager process of this user
    /// on the node may hold together (a ledger in `/dev/shm`; a killed process's share
    /// comes back). A release whose new backups would pass it fails before anything moves,
    /// as out of memory naming the budget and each process's share, as does swap space
    /// over it (default: no budget; the environment variable `GPU_PAGER_HOST_BUDGET`, e.g.
    /// `64G`, sets it for the process's pagers).
    host_budget_bytes: usize = usize::MAX;
    /// Every preserve region with a pinned backup is created with `prepin` on: its backup
    /// is pinned as the region is created (fixed) or as each buffer is allocated (growing),
    /// so that its first release pins nothing and copies at the link. Off (the default), the
    /// first release pins while it copies, bound by how fast the host pins. The host memory
    /// is taken for every such region, also one whose contents a release usually drops (the
    /// vLLM drop-in's `kv_cache`): it suits processes whose preserve regions are all saved,
    /// as a trainer's under the torch_memory_saver drop-in (the environment variable
    /// `GPU_PAGER_PREPIN=1` turns it on, for engines that cannot pass the option).
    prepin: bool = false;
}

impl PagerConfig {
    /// The defaults with the settings of `text` applied: `name=value` pairs separated by
    /// commas, semicolons or white space (`"chunk_bytes=64M, skip_unchanged=false"`), each
    /// value as its kind spells it ([`SettingValue::parse`]); the empty text is the
    /// defaults. An unknown name or a bad value is [`Error::InvalidArgument`] naming it.
    pub fn parse(text: &str) -> Result<PagerConfig> {
        let mut config = PagerConfig::default();
        let mut seen: Vec<&str> = Vec::new();
        for pair in text
            .split(|c: char| c == ',' || c == ';' || c.is_whitespace())
            .filter(|p| !p.is_empty())
        {
            let Some((name, value)) = pair.split_once('=') else {
                return Err(Error::InvalidArgument {
                    tag: None,
                    reason: format!("{} is not name=value, e.g. chunk_bytes=64M", quoted(pair)),
                });
            };
            let setting = Setting::find(name.trim())?;
            if seen.contains(&setting.name) {
                return Err(Error::InvalidArgument {
                    tag: None,
                    reason: format!(
                        "setting {} is given twice; give each setting once",
                        setting.name
                    ),
                });
            }
            seen.push(setting.name);
            setting.set_text(&mut config, value)?;
        }
        Ok(config)
    }
}

/// `text` quoted for a message, cut to its first 60 characters (a setting's text may be
/// long, and an error quotes it).
pub(crate) fn quoted(text: &str) -> String {
    const MOST: usize = 60;
    match text.char_indices().nth(MOST) {
        None => format!("{text:?}"),
        Some((end, _)) => format!("{:?}... ({} bytes)", &text[..end], text.len()),
    }
}

/// The settings as the bindings name them (the tuning is left out), e.g.
/// `chunk_bytes=536870912, skip_unchanged=true, ...`.
impl fmt::Display for PagerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in SETTINGS.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{}={}", s.name, s.get(self))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_reads_back_what_it_is_set_to_and_defaults_agree() {
        let defaults = PagerConfig::default();
        for s in SETTINGS {
            assert_eq!(s.get(&defaults), s.default(), "{}", s.name);
            assert_eq!(s.get(&defaults).kind(), s.kind, "{}", s.name);
            assert!(!s.doc().is_empty() && !s.doc().contains("  "), "{}", s.name);
            let mut c = defaults;
            let other = match s.kind {
                SettingKind::Bytes => SettingValue::Bytes(12345),
                SettingKind::Switch => {
                    SettingValue::Switch(!matches!(s.get(&c), SettingValue::Switch(true)))
                }
                SettingKind::Route => SettingValue::Route(CopyRoute::Kernel),
            };
            s.set(&mut c, other).unwrap();
            assert_eq!(s.get(&c), other, "{}", s.name);
            // Only this field changed.
            for t in SETTINGS.iter().filter(|t| t.name != s.name) {
                assert_eq!(t.get(&c), t.get(&defaults), "{} moved {}", s.name, t.name);
            }
            assert_eq!(c.tuning, defaults.tuning);
        }
    }

    #[test]
    fn values_of_another_kind_and_unknown_names_are_refused_with_the_choices() {
        let mut c = PagerConfig::default();
        let e = Setting::find("chunk_bytes")
            .unwrap()
            .set(&mut c, SettingValue::Switch(true))
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("takes a bytes value, not a switch one"),
            "{e}"
        );
        let e = Setting::find("chunk_size").unwrap_err();
        assert!(
            e.to_string().contains("no setting is named \"chunk_size\""),
            "{e}"
        );
        assert!(e.to_string().contains("chunk_bytes, skip_unchanged"), "{e}");
        assert_eq!(c, PagerConfig::default(), "nothing changed");
    }

    #[test]
    fn text_values_parse_as_each_kind_spells_them() {
        use SettingValue::*;
        let p = SettingValue::parse;
        assert_eq!(p(SettingKind::Bytes, "512M"), Ok(Bytes(512 << 20)));
        assert_eq!(p(SettingKind::Bytes, " 4GiB "), Ok(Bytes(4 << 30)));
        assert_eq!(p(SettingKind::Bytes, "1024"), Ok(Bytes(1024)));
        assert_eq!(p(SettingKind::Bytes, "max"), Ok(Bytes(usize::MAX)));
        assert!(p(SettingKind::Bytes, "-1").is_err());
        assert!(p(SettingKind::Bytes, "99999999999T").is_err(), "overflow");
        assert_eq!(p(SettingKind::Switch, "Yes"), Ok(Switch(true)));
        assert_eq!(p(SettingKind::Switch, "0"), Ok(Switch(false)));
        assert!(
            p(SettingKind::Switch, "2")
                .unwrap_err()
                .contains("a switch")
        );
        assert_eq!(
            p(SettingKind::Route, "kernel"),
            Ok(Route(CopyRoute::Kernel))
        );
        let e = p(SettingKind::Route, "dma").unwrap_err();
        assert!(e.contains("engine, kernel, fastest"), "{e}");
        let mut c = PagerConfig::default();
        Setting::find("save_route")
            .unwrap()
            .set_text(&mut c, "fastest")
            .unwrap();
        assert_eq!(c.save_route, CopyRoute::Fastest);
    }

    #[test]
    fn settings_as_text_read_back_and_bad_text_names_the_fault() {
        let c = PagerConfig::parse("chunk_bytes=64M, skip_unchanged=false;save_route=kernel\n")
            .unwrap();
        assert_eq!(
            (c.chunk_bytes, c.skip_unchanged, c.save_route),
            (64 << 20, false, CopyRoute::Kernel)
        );
        assert_eq!(PagerConfig::parse("").unwrap(), PagerConfig::default());
        // What Display prints reads back as the same settings.
        assert_eq!(PagerConfig::parse(&c.to_string()).unwrap(), c);
        let e = PagerConfig::parse("chunk_bytes").unwrap_err().to_string();
        assert!(e.contains("is not name=value"), "{e}");
        let e = PagerConfig::parse("verify_restore=maybe")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("setting verify_restore: \"maybe\" is not a switch"),
            "{e}"
        );
        let e = PagerConfig::parse("chunks=1").unwrap_err().to_string();
        assert!(e.contains("no setting is named \"chunks\""), "{e}");
    }

    #[test]
    fn a_setting_given_twice_is_refused_and_long_text_is_not_echoed_whole() {
        let e = PagerConfig::parse("chunk_bytes=64M, skip_unchanged=false, chunk_bytes=2M")
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert!(
            e.to_string().contains("setting chunk_bytes is given twice"),
            "{e}"
        );
        let long = "x".repeat(1 << 20);
        for text in [
            format!("verify_restore={long}"),
            format!("{long}=1"),
            long.clone(),
        ] {
            let e = PagerConfig::parse(&text).unwrap_err().to_string();
            assert!(e.len() < 1000, "{} bytes of message", e.len());
            assert!(e.contains(&format!("({} bytes)", 1 << 20)), "{e}");
        }
    }

    #[test]
    fn an_unknown_setting_near_a_known_one_is_named() {
        let e = PagerConfig::parse("chunk_byte=64M")
            .unwrap_err()
            .to_string();
        assert!(e.contains("(did you mean chunk_bytes?)"), "{e}");
        let e = PagerConfig::parse("zzz=1").unwrap_err().to_string();
        assert!(!e.contains("did you mean"), "{e}");
    }

    #[test]
    fn the_settings_print_as_name_equals_value() {
        let shown = PagerConfig::default().to_string();
        assert!(
            shown.starts_with("chunk_bytes=536870912, skip_unchanged=true"),
            "{shown}"
        );
        assert!(
            shown.contains("save_route=engine, restore_route=fastest"),
            "{shown}"
        );
        assert_eq!(shown.matches('=').count(), SETTINGS.len());
    }
}
