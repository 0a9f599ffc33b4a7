//! Short names of the core's enums as every binding spells them (`"pinned"`, `"growing"`,
//! `"fastest"`, ...), in one table per enum, and how byte counts and switches are spelled
//! as text (settings, environment variables).

/// `ALL`, `name` and `from_name` for a fieldless enum, from one table of variant and name:
///
/// ```ignore
/// short_names!(Medium, "medium", { Pinned => "pinned", Host => "host", File => "file" });
/// ```
macro_rules! short_names {
    ($ty:ident, $what:literal, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            #[doc = concat!("Every ", $what, ".")]
            pub const ALL: [$ty; [$($name),+].len()] = [$($ty::$variant),+];

            #[doc = concat!("The ", $what, "'s short name, as the bindings spell it: ",
                $("`\"", $name, "\"` "),+)]
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }

            #[doc = concat!("The ", $what, " with this short name, if any.")]
            pub fn from_name(name: &str) -> Option<$ty> {
                Self::ALL.into_iter().find(|v| v.name() == name)
            }
        }
    };
}

pub(crate) use short_names;

/// A byte count as text, as every setting and environment variable of the library spells
/// one: `"1073741824"`, `"512M"`, `"1.5G"`, `"1T"` (binary units; a trailing `B` or `iB`
/// is accepted), or `max`.
pub(crate) fn parse_bytes(t: &str) -> Option<usize> {
    let t = t.trim();
    if t.eq_ignore_ascii_case("max") {
        return Some(usize::MAX);
    }
    let n = parse_size::Config::new().with_binary().parse_size(t).ok()?;
    usize::try_from(n).ok()
}

/// A switch as text: `1`, `true` or `yes` on, `0`, `false` or `no` off (any case, spaces
/// trimmed).
pub(crate) fn parse_switch(t: &str) -> Option<bool> {
    match t.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" => Some(true),
        "0" | "false" | "no" => Some(false),
        _ => None,
    }
}

/// `bytes` as GiB with two decimals, as messages and tables show sizes.
pub(crate) fn gib(bytes: usize) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// `bytes` as a message shows a size of any magnitude: in GiB from 1 GiB, in MiB from
/// 1 MiB, else in bytes.
pub(crate) fn size(bytes: usize) -> String {
    if bytes >= 1 << 30 {
        gib(bytes)
    } else if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
    } else {
        format!("{bytes} bytes")
    }
}
