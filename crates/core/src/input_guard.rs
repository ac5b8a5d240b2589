//! The one rule that keeps broken input from wiping a node, for `sync --once` and for
//! the first sync of `kproxy run`: a state built from input that holds no Service, or
//! that lost objects to a file or document that could not be read or parsed (or, from
//! the API, an object that could not be decoded), is not programmed over kproxy's
//! tables when those hold Services (the rules in place are then the last known good
//! state). `--allow-empty` and `--allow-partial` opt in. Partial input whose plan the
//! tables already hold exactly is not refused: programming it changes nothing, and
//! holding it would keep every later change out for as long as the input stays
//! partial (one unrelated broken file, for good). [`refusal`] decides; the node agent
//! reads what the kernel holds (`kproxy::input_guard`).

/// What the input gave, as the guard needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Input {
    /// The plan holds no Service.
    pub empty: bool,
    /// A file or document could not be read or parsed: the state may lack objects that
    /// nobody named.
    pub lost: bool,
}

/// What the operator allowed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allow {
    pub empty: bool,
    pub partial: bool,
}

/// Why a state is not programmed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Some input could not be read or parsed.
    Lost,
    /// The input holds no Service while kproxy's tables hold `rules` rules and
    /// `elements` set elements more than an empty input leaves.
    Empty { rules: usize, elements: usize },
}

impl Refusal {
    /// The flag that programs anyway.
    pub fn flag(self) -> &'static str {
        match self {
            Refusal::Lost => "--allow-partial",
            Refusal::Empty { .. } => "--allow-empty",
        }
    }

    /// The explanation, naming the input (`input`: "the manifests in PATH", or the API
    /// server's lists) and the table.
    pub fn message(self, input: &str, table: &str) -> String {
        match self {
            Refusal::Lost => format!(
                "some of {input} could not be read or parsed, and the rules in place in kproxy's tables ({table}) may hold their objects; {} programs anyway",
                self.flag()
            ),
            Refusal::Empty { rules, elements } => format!(
                "{input} hold no Service, and kproxy's tables ({table}) hold {rules} rules and {elements} set elements more than an empty input leaves; an empty or cut-short input must not wipe them ({} programs anyway)",
                self.flag()
            ),
        }
    }
}

/// What kproxy's tables in the kernel hold, as the guard needs it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Kernel {
    /// Rules and set elements beyond what an empty input leaves (`None`: absent,
    /// unreadable or nothing more).
    pub more: Option<(usize, usize)>,
    /// The tables hold exactly what the input plans: programming it changes nothing.
    pub same: bool,
}

/// Whether to refuse programming a state. `lost_needs_kernel` says whether lost input
/// is refused only when the kernel holds more (`run`: a fresh node has nothing to
/// lose) or always (`sync --once`, which refuses before touching the kernel). Lost
/// input whose plan the kernel holds exactly is never refused.
pub fn refusal(
    input: Input,
    kernel: Kernel,
    allow: Allow,
    lost_needs_kernel: bool,
) -> Option<Refusal> {
    let kernel_more = kernel.more;
    if input.lost && !allow.partial && !kernel.same && (!lost_needs_kernel || kernel_more.is_some())
    {
        return Some(Refusal::Lost);
    }
    match kernel_more {
        Some((rules, elements)) if input.empty && !allow.empty => {
            Some(Refusal::Empty { rules, elements })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broken_or_empty_input_is_refused_only_over_tables_that_hold_services() {
        let more = Some((12, 3));
        let ok = Input {
            empty: false,
            lost: false,
        };
        let empty = Input {
            empty: true,
            lost: false,
        };
        let lost = Input {
            empty: false,
            lost: true,
        };
        let none = Allow::default();
        let all = Allow {
            empty: true,
            partial: true,
        };
        /// input, what the kernel holds more, what is allowed, `lost_needs_kernel`, want.
        type Row = (Input, Option<(usize, usize)>, Allow, bool, Option<Refusal>);
        let rows: [Row; 10] = [
            (ok, more, none, true, None),
            (
                empty,
                more,
                none,
                true,
                Some(Refusal::Empty {
                    rules: 12,
                    elements: 3,
                }),
            ),
            (empty, None, none, true, None),
            (empty, more, all, true, None),
            (lost, more, none, true, Some(Refusal::Lost)),
            // `run` on a fresh node: nothing to lose.
            (lost, None, none, true, None),
            // `sync --once` refuses lost input without asking the kernel.
            (lost, None, none, false, Some(Refusal::Lost)),
            (lost, more, all, false, None),
            (
                Input {
                    empty: true,
                    lost: true,
                },
                more,
                Allow {
                    empty: false,
                    partial: true,
                },
                true,
                Some(Refusal::Empty {
                    rules: 12,
                    elements: 3,
                }),
            ),
            (
                Input {
                    empty: true,
                    lost: true,
                },
                more,
                none,
                true,
                Some(Refusal::Lost),
            ),
        ];
        for (i, (input, more, allow, needs, want)) in rows.into_iter().enumerate() {
            let kernel = Kernel { more, same: false };
            assert_eq!(refusal(input, kernel, allow, needs), want, "row {i}");
        }
    }

    /// One unrelated broken file made the restart guard hold for good, although the
    /// kernel held exactly what the partial input plans: endpoint changes never
    /// applied, `/healthz` and then `/livez` 503, a restart loop. Partial input whose
    /// plan the kernel holds exactly is programmed; partial input that would remove
    /// what the kernel holds is still held.
    #[test]
    fn partial_input_the_kernel_already_holds_exactly_is_not_held() {
        let lost = Input {
            empty: false,
            lost: true,
        };
        let none = Allow::default();
        let same = Kernel {
            more: Some((12, 3)),
            same: true,
        };
        let differs = Kernel {
            more: Some((12, 3)),
            same: false,
        };
        assert_eq!(refusal(lost, same, none, true), None);
        assert_eq!(refusal(lost, differs, none, true), Some(Refusal::Lost));
        // An empty input is refused over tables that hold Services whatever `same`
        // says (the tables then hold more than an empty plan).
        let empty = Input {
            empty: true,
            lost: true,
        };
        assert!(refusal(empty, same, none, true).is_some());
    }
}
