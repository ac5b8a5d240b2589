//! One name per value: for the scenario's `clap::ValueEnum`s, the name the derive gives
//! a variant (its kebab-case, or its `#[value(name)]`) is the name everywhere else too.
//! `named_by_value_enum!` writes it for `Display` (cell ids, reports) and `Serialize`
//! (JSON), so no second table of strings can drift from the command line.

/// Implements `Display` and `Serialize` for a `clap::ValueEnum` as its command-line
/// name.
macro_rules! named_by_value_enum {
    ($t:ty) => {
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                let value = clap::ValueEnum::to_possible_value(self)
                    .expect("the scenario's value enums skip no variant");
                f.pad(value.get_name())
            }
        }

        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
    };
}

pub(crate) use named_by_value_enum;
