//! Short names of the core's enums as every binding spells them (`"pinned"`, `"growing"`,
//! `"fastest"`, ...), in one table per enum.

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
